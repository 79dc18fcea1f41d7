// Matmul by a group-quantized weight on CPU, with the activations quantized to int8 per
// block of 32 features and integer dot products (llama.cpp's route for its Q4 / Q8 types,
// and oneDNN's for int8 GEMMs): the weight's float values are never made, not even a tile.
//
// The weight, W[n, k] = scale[n, g] * code[n, k] + offset[n, g] with g = k / group_size,
// is repacked once at load time (paged_llm's `cpu_matmul.pack`) so that one 64-byte vector
// holds 16 output rows by 4 consecutive features, the operand of AVX-512 VNNI's vpdpbusd
// with one broadcast group of 4 activation bytes:
//   4-bit codes: blocks of 16 rows x 8 features; byte 4 * l + j holds code(n0 + l, k0 + j)
//                in its low nibble and code(n0 + l, k0 + 4 + j) in its high one;
//   8-bit codes: blocks of 16 rows x 4 features; byte 4 * l + j is code(n0 + l, k0 + j),
//                signed;
// blocks in the order [row block][feature block]; scales and offsets [row block][group][16].
// Rows are padded to a multiple of 16 and features to one of 32 with zero codes.
//
// Each activation row is quantized per block of 32 features to int8 codes q with a float32
// scale d:  d = amax / 127,  q = nearbyint(x * (127 / amax))  (0 where amax is 0), and
//   out[m, n] = sum over spans of (scale * d) * (integer sum of code * q over the span)
//             + sum_g offset[n, g] * (sum over k in g of d * q_k)
// where a span is 32 features (16 for groups of 16): one group and one activation block.
// The integer sums are exact; the passes differ only in the order of float32 additions.
//
// Passes: AVX-512 with VNNI (vpdpbusd: 64 byte products per instruction; 8-bit codes are
// made unsigned by adding 128, and 128 times the activations' sum is taken off) and AVX2
// (vpmaddubsw + vpmaddwd; 8-bit codes move their sign onto the activation, so the products
// fit 16 bits); generic loops everywhere else.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"

namespace {

enum Isa : int64_t { kGeneric = 0, kAvx2 = 1, kAvx512Vnni = 2 };

constexpr int64_t kRowsPerBlock = 16;  // output rows of one packed block (a vector's lanes)
constexpr int64_t kActBlock = 32;  // activation features that share one scale
constexpr int64_t kBlockBytes = 64;
// Multiply-adds per parallel task: a decode step's matmul by a small projection still
// splits over the cores, where torch's grain (32768 elements) would keep it on one.
constexpr int64_t kMacsPerTask = 1 << 16;

bool compiled(Isa isa) {
  switch (isa) {
    case kGeneric:
      return true;
    case kAvx2:
#if defined(__AVX2__) && defined(__FMA__)
      return true;
#else
      return false;
#endif
    case kAvx512Vnni:
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
      return true;
#else
      return false;
#endif
  }
  return false;
}

struct Problem {
  int64_t rows;  // M
  int64_t out_features;  // N
  int64_t in_features;  // K
  int64_t padded_features;  // K rounded up to kActBlock
  int64_t group_size;  // >= K: one group a row
  int64_t num_groups;
  int64_t span;  // features of one integer sum: 32, or 16 for groups of 16
  bool nibbles;
  bool has_offset;
  Isa isa;
  int64_t row_blocks;
  int64_t block_stride;  // bytes of one row block's codes
};

// The activations as the passes read them.
struct QuantizedActivations {
  std::vector<int8_t> q;  // [M, padded K], zero past K
  std::vector<float> scale;  // [M, padded K / 32]
  std::vector<int32_t> span_sums;  // [M, padded K / span]: sum of q (8-bit codes only)
  std::vector<float> group_sums;  // [M, groups]: sum over k in g of d * q (offsets only)
};

// One activation row's int8 codes and block scales.
template <typename T>
void quantize_row(const T* row, int64_t size, int64_t block, int8_t* q, float* scales) {
  const int64_t num_blocks = (size + block - 1) / block;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * block, end = std::min(size, start + block);
    float amax = 0.0f;
    for (int64_t k = start; k < end; ++k) amax = std::max(amax, std::fabs(paged_llm_cpu::load(row + k)));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    scales[b] = amax / 127.0f;
    for (int64_t k = start; k < end; ++k) {
      const float v = std::nearbyint(paged_llm_cpu::load(row + k) * inverse);
      q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
}

template <typename T>
QuantizedActivations quantize_activations(const Problem& p, const T* x, int64_t x_stride) {
  const int64_t M = p.rows, K = p.in_features, Kp = p.padded_features;
  QuantizedActivations a;
  a.q.assign(M * Kp, 0);
  a.scale.assign(M * (Kp / kActBlock), 0.0f);
  if (!p.nibbles) a.span_sums.resize(M * (Kp / p.span));
  if (p.has_offset) a.group_sums.assign(M * p.num_groups, 0.0f);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / Kp), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = a.q.data() + m * Kp;
      float* scales = a.scale.data() + m * (Kp / kActBlock);
      quantize_row(x + m * x_stride, K, kActBlock, q, scales);
      if (!p.nibbles) {
        for (int64_t s = 0; s < Kp / p.span; ++s) {
          int32_t sum = 0;
          for (int64_t k = s * p.span; k < (s + 1) * p.span; ++k) sum += q[k];
          a.span_sums[m * (Kp / p.span) + s] = sum;
        }
      }
      if (p.has_offset) {
        float* sums = a.group_sums.data() + m * p.num_groups;
        for (int64_t k = 0; k < K; ++k) {
          sums[std::min(k / p.group_size, p.num_groups - 1)] += scales[k / kActBlock] * static_cast<float>(q[k]);
        }
      }
    }
  });
  return a;
}

// The code of row lane l, feature k of a row block in the packed layout.
inline int32_t packed_code(const uint8_t* block_codes, bool nibbles, int64_t lane, int64_t k) {
  if (nibbles) {
    const uint8_t byte = block_codes[(k / 8) * kBlockBytes + 4 * lane + k % 4];
    return (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
  }
  return static_cast<int8_t>(block_codes[(k / 4) * kBlockBytes + 4 * lane + k % 4]);
}

// Group of the span starting at feature k (the last group for a row's padding).
inline int64_t group_of(const Problem& p, int64_t k) { return std::min(k / p.group_size, p.num_groups - 1); }

// out[m0 + t, n0 + l] for t < tile, l < 16, into result[t * 16 + l].
void generic_tile(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t tile, float* result) {
  const int64_t Kp = p.padded_features;
  for (int64_t t = 0; t < tile; ++t) {
    const int8_t* q = a.q.data() + (m0 + t) * Kp;
    const float* d = a.scale.data() + (m0 + t) * (Kp / kActBlock);
    for (int64_t lane = 0; lane < kRowsPerBlock; ++lane) {
      float total = 0.0f;
      for (int64_t k0 = 0; k0 < Kp; k0 += p.span) {
        int32_t sum = 0;
        for (int64_t k = k0; k < k0 + p.span; ++k) sum += packed_code(codes, p.nibbles, lane, k) * q[k];
        total += scale[group_of(p, k0) * kRowsPerBlock + lane] * d[k0 / kActBlock] * static_cast<float>(sum);
      }
      if (offset != nullptr) {
        const float* sums = a.group_sums.data() + (m0 + t) * p.num_groups;
        for (int64_t g = 0; g < p.num_groups; ++g) total += offset[g * kRowsPerBlock + lane] * sums[g];
      }
      result[t * kRowsPerBlock + lane] = total;
    }
  }
}

inline int32_t four_bytes(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof(v));
  return v;
}

// The activation rows m0 .. m0 + kTile of a vector pass: their codes and block scales.
template <int kTile>
struct TileRows {
  const int8_t* q[kTile];
  const float* d[kTile];

  TileRows(const Problem& p, const QuantizedActivations& a, int64_t m0) {
    for (int t = 0; t < kTile; ++t) {
      q[t] = a.q.data() + (m0 + t) * p.padded_features;
      d[t] = a.scale.data() + (m0 + t) * (p.padded_features / kActBlock);
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
template <bool kNibbles, int kTile>
void avx512_tile(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, float* result) {
  const int64_t Kp = p.padded_features, S = p.span;
  const TileRows<kTile> rows(p, a, m0);
  const int8_t* const* q = rows.q;
  const float* const* d = rows.d;
  __m512 acc[kTile];
  for (int t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i sign_flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k0 = 0; k0 < Kp; k0 += S) {
    __m512i sums[kTile];
    for (int t = 0; t < kTile; ++t) sums[t] = _mm512_setzero_si512();
    if constexpr (kNibbles) {
      for (int64_t k = k0; k < k0 + S; k += 8) {
        const __m512i w = _mm512_loadu_si512(codes + (k / 8) * kBlockBytes);
        const __m512i low = _mm512_and_si512(w, low_mask);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(w, 4), low_mask);
        for (int t = 0; t < kTile; ++t) {
          sums[t] = _mm512_dpbusd_epi32(sums[t], low, _mm512_set1_epi32(four_bytes(q[t] + k)));
          sums[t] = _mm512_dpbusd_epi32(sums[t], high, _mm512_set1_epi32(four_bytes(q[t] + k + 4)));
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + S; k += 4) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(codes + (k / 4) * kBlockBytes), sign_flip);
        for (int t = 0; t < kTile; ++t) {
          sums[t] = _mm512_dpbusd_epi32(sums[t], w, _mm512_set1_epi32(four_bytes(q[t] + k)));
        }
      }
      for (int t = 0; t < kTile; ++t) {
        const int32_t correction = 128 * a.span_sums[(m0 + t) * (Kp / S) + k0 / S];
        sums[t] = _mm512_sub_epi32(sums[t], _mm512_set1_epi32(correction));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + group_of(p, k0) * kRowsPerBlock);
    for (int t = 0; t < kTile; ++t) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(d[t][k0 / kActBlock]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), sd, acc[t]);
    }
  }
  if (offset != nullptr) {
    for (int64_t g = 0; g < p.num_groups; ++g) {
      const __m512 o = _mm512_loadu_ps(offset + g * kRowsPerBlock);
      for (int t = 0; t < kTile; ++t) {
        acc[t] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.group_sums[(m0 + t) * p.num_groups + g]), acc[t]);
      }
    }
  }
  for (int t = 0; t < kTile; ++t) _mm512_storeu_ps(result + t * kRowsPerBlock, acc[t]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The 8 sums of 4 products of 32 codes (unsigned, at most 15) and activations.
inline __m256i dot_unsigned(__m256i codes, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

// The same for signed 8-bit codes: |code| times x with code's sign, which fits 16 bits.
inline __m256i dot_signed(__m256i codes, __m256i x) {
  const __m256i products = _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(x, codes));
  return _mm256_madd_epi16(products, _mm256_set1_epi16(1));
}

// A 64-byte block as two vectors of 8 rows each: rows 0-7, then rows 8-15.
template <bool kNibbles, int kTile>
void avx2_tile(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, float* result) {
  const int64_t Kp = p.padded_features, S = p.span;
  const TileRows<kTile> rows(p, a, m0);
  const int8_t* const* q = rows.q;
  const float* const* d = rows.d;
  __m256 acc[kTile][2];
  for (int t = 0; t < kTile; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < Kp; k0 += S) {
    __m256i sums[kTile][2];
    for (int t = 0; t < kTile; ++t) sums[t][0] = sums[t][1] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k0 + S; k += kNibbles ? 8 : 4) {
      const uint8_t* block = codes + (k / (kNibbles ? 8 : 4)) * kBlockBytes;
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * h));
        if constexpr (kNibbles) {
          const __m256i low = _mm256_and_si256(w, low_mask);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(w, 4), low_mask);
          for (int t = 0; t < kTile; ++t) {
            const __m256i x_low = _mm256_set1_epi32(four_bytes(q[t] + k));
            const __m256i x_high = _mm256_set1_epi32(four_bytes(q[t] + k + 4));
            sums[t][h] = _mm256_add_epi32(sums[t][h],
                _mm256_add_epi32(dot_unsigned(low, x_low), dot_unsigned(high, x_high)));
          }
        } else {
          for (int t = 0; t < kTile; ++t) {
            sums[t][h] = _mm256_add_epi32(sums[t][h], dot_signed(w, _mm256_set1_epi32(four_bytes(q[t] + k))));
          }
        }
      }
    }
    const float* s = scale + group_of(p, k0) * kRowsPerBlock;
    for (int t = 0; t < kTile; ++t) {
      const __m256 dt = _mm256_set1_ps(d[t][k0 / kActBlock]);
      for (int h = 0; h < 2; ++h) {
        const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(s + 8 * h), dt);
        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t][h]), sd, acc[t][h]);
      }
    }
  }
  if (offset != nullptr) {
    for (int64_t g = 0; g < p.num_groups; ++g) {
      for (int t = 0; t < kTile; ++t) {
        const __m256 x_sum = _mm256_set1_ps(a.group_sums[(m0 + t) * p.num_groups + g]);
        for (int h = 0; h < 2; ++h) {
          acc[t][h] = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g * kRowsPerBlock + 8 * h), x_sum, acc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < kTile; ++t) {
    _mm256_storeu_ps(result + t * kRowsPerBlock, acc[t][0]);
    _mm256_storeu_ps(result + t * kRowsPerBlock + 8, acc[t][1]);
  }
}
#endif

using Tile = void (*)(const Problem&, const QuantizedActivations&, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t tile, float* result);

// A pass over up to `kMaxTile` activation rows, dispatched to its fixed-size tiles.
template <template <bool, int> class Pass, bool kNibbles, int kMaxTile>
void tiles(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t tile, float* result) {
  if constexpr (kMaxTile == 0) {
    return;
  } else {
    if (tile == kMaxTile) return Pass<kNibbles, kMaxTile>::run(p, a, codes, scale, offset, m0, result);
    return tiles<Pass, kNibbles, kMaxTile - 1>(p, a, codes, scale, offset, m0, tile, result);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
template <bool kNibbles, int kTile>
struct Avx512Pass {
  static void run(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
      const float* scale, const float* offset, int64_t m0, float* result) {
    avx512_tile<kNibbles, kTile>(p, a, codes, scale, offset, m0, result);
  }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <bool kNibbles, int kTile>
struct Avx2Pass {
  static void run(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
      const float* scale, const float* offset, int64_t m0, float* result) {
    avx2_tile<kNibbles, kTile>(p, a, codes, scale, offset, m0, result);
  }
};
#endif

// The pass's tile function and the most activation rows it takes at once (what its
// registers hold: an integer and a float accumulator per row).
std::pair<Tile, int64_t> pass(const Problem& p) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (p.isa == kAvx512Vnni) {
    return {p.nibbles ? tiles<Avx512Pass, true, 8> : tiles<Avx512Pass, false, 8>, 8};
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (p.isa == kAvx2) return {p.nibbles ? tiles<Avx2Pass, true, 2> : tiles<Avx2Pass, false, 2>, 2};
#endif
  return {generic_tile, 4};
}

template <typename T>
void matmul_impl(const Problem& p, const at::Tensor& x, const at::Tensor& codes,
    const at::Tensor& scale, const c10::optional<at::Tensor>& offset, at::Tensor& out) {
  const QuantizedActivations a = quantize_activations<T>(p, x.const_data_ptr<T>(), x.stride(0));
  const auto [tile_fn, max_tile] = pass(p);
  const uint8_t* code_data = codes.const_data_ptr<uint8_t>();
  const float* scale_data = scale.const_data_ptr<float>();
  const float* offset_data = offset.has_value() ? offset->const_data_ptr<float>() : nullptr;
  const int64_t group_stride = p.num_groups * kRowsPerBlock;
  T* out_data = out.data_ptr<T>();
  const int64_t out_stride = out.stride(0);
  const int64_t macs = std::max<int64_t>(1, p.rows * p.padded_features * kRowsPerBlock);
  at::parallel_for(0, p.row_blocks, std::max<int64_t>(1, kMacsPerTask / macs), [&](int64_t b0, int64_t b1) {
    std::vector<float> result(max_tile * kRowsPerBlock);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsPerBlock, valid = std::min(kRowsPerBlock, p.out_features - n0);
      for (int64_t m0 = 0; m0 < p.rows; m0 += max_tile) {
        const int64_t tile = std::min(max_tile, p.rows - m0);
        tile_fn(p, a, code_data + b * p.block_stride, scale_data + b * group_stride,
            offset_data ? offset_data + b * group_stride : nullptr, m0, tile, result.data());
        for (int64_t t = 0; t < tile; ++t) {
          T* row = out_data + (m0 + t) * out_stride + n0;
          for (int64_t l = 0; l < valid; ++l) paged_llm_cpu::store(row + l, result[t * kRowsPerBlock + l]);
        }
      }
    }
  });
}

// out [M, N] (x's dtype) = x [M, K] (float32 or bfloat16, rows contiguous) times the
// transposed weight packed as above (codes [N16 / 16, bytes] uint8, scale and offset
// [N16 / 16, groups, 16] float32). `isa`: 0 generic, 1 AVX2, 2 AVX-512 VNNI.
void packed_quantized_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
    const c10::optional<at::Tensor>& offset, int64_t out_features, int64_t group_size, bool nibbles,
    int64_t isa, at::Tensor& out) {
  TORCH_CHECK(isa >= kGeneric && isa <= kAvx512Vnni, "isa must be 0, 1 or 2");
  TORCH_CHECK(compiled(static_cast<Isa>(isa)), "this build has no pass ", isa);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes must be contiguous uint8");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat, "scale must be contiguous float32");
  TORCH_CHECK(!offset.has_value() || (offset->is_contiguous() && offset->scalar_type() == at::kFloat),
      "offset must be contiguous float32");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.stride(1) == 1, "out must be x's dtype");
  Problem p{};
  p.rows = x.size(0);
  p.in_features = x.size(1);
  p.out_features = out_features;
  p.padded_features = (p.in_features + kActBlock - 1) / kActBlock * kActBlock;
  p.group_size = std::min(group_size, p.padded_features);
  p.num_groups = scale.size(1);
  p.span = p.group_size == 16 ? 16 : kActBlock;
  TORCH_CHECK(p.group_size == 16 || p.group_size % kActBlock == 0 || group_size >= p.in_features,
      "groups must be 16 features, a multiple of 32, or whole rows");
  p.nibbles = nibbles;
  p.has_offset = offset.has_value();
  p.isa = static_cast<Isa>(isa);
  p.row_blocks = codes.size(0);
  p.block_stride = codes.size(1);
  TORCH_CHECK(p.block_stride == p.padded_features * (nibbles ? 8 : 16), "codes do not match x's features");
  TORCH_CHECK(p.row_blocks * kRowsPerBlock >= out_features && out.size(1) == out_features, "rows do not match");
  if (x.scalar_type() == at::kFloat) {
    matmul_impl<float>(p, x, codes, scale, offset, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    matmul_impl<c10::BFloat16>(p, x, codes, scale, offset, out);
  }
}

// The passes this build has, best first; the generic loops (0) always.
std::vector<int64_t> quantized_matmul_isas() {
  std::vector<int64_t> isas;
  for (Isa isa : {kAvx512Vnni, kAvx2, kGeneric}) {
    if (compiled(isa)) isas.push_back(isa);
  }
  return isas;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_llm_cpu, m) {
  m.def(
      "packed_quantized_matmul(Tensor x, Tensor codes, Tensor scale, Tensor? offset, "
      "int out_features, int group_size, bool nibbles, int isa, Tensor(a!) out) -> ()");
  m.def("quantized_matmul_isas() -> int[]");
  m.impl("packed_quantized_matmul", c10::DispatchKey::CPU, &packed_quantized_matmul);
  m.impl("quantized_matmul_isas", c10::DispatchKey::CatchAll, &quantized_matmul_isas);
}
