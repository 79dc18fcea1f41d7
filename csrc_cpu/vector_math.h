// Float32 loops that vectorize, shared by the kernels of csrc_cpu. Sums keep a fixed order
// of additions (kLanes partial sums, then halvings), so results do not depend on the
// machine's vector width or on the thread that computes them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace paged_llm_cpu {

// Lanes of the independent partial sums in `dot` and `sum`: wide enough for the compiler
// to fill AVX-512 (or two AVX2) registers; the order of a dot product's additions is fixed
// by it, not by the machine's vector width.
constexpr int64_t kLanes = 16;

// The lanes' sum, added pairwise in a fixed order: the compiler turns each halving into
// vector adds, where a running scalar sum made a 16-long chain of dependent additions (most
// of a dot product's time at head_dim 64).
inline float sum_lanes(float* lanes) {
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = sum_lanes(lanes);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) within 2 ulp of std::exp for x in [-87, 88] (clamped outside, where 2^n would
// leave float32's normal range: exp is ~0 or ~inf there): Cephes' expf polynomial on
// x - n ln 2, times 2^n built from its exponent bits. Plain arithmetic, so a loop of it
// vectorizes, where std::exp is one library call per element.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float sum(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  }
  float total = sum_lanes(lanes);
  for (; i < n; ++i) total += x[i];
  return total;
}

}  // namespace paged_llm_cpu
