// Decode attention over the paged KV cache, read in place (no gather into a workspace).
//
// The cache is the torch backend's head-major layout, [Hkv, num_blocks, block_size, D].
// One task per (query token, KV head) computes the G query heads that share that KV head,
// so every key and value row is read once per token and stays in L1 while the G heads use
// it. Scores and sums are float32 whatever the cache dtype; a task's arithmetic depends
// only on its own query and context, never on the rest of the step or on the threads, so
// results are batch invariant.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "convert.h"
#include "vector_math.h"

// The vector passes below: AVX-512 where the build has it, else AVX2 with FMA and F16C.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PAGED_LLM_VECTOR_PASSES
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using paged_llm_cpu::dot;
using paged_llm_cpu::exp_clamped;
using paged_llm_cpu::sum;

// An fp8 byte's float value, from a table built once (cheaper than decoding bits per
// element in the inner loop).
template <typename Fp8>
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int bits = 0; bits < 256; ++bits) {
      values[bits] = static_cast<float>(Fp8(static_cast<uint8_t>(bits), Fp8::from_bits()));
    }
    return values;
  }();
  return table;
}

// One cache row of `head_dim` elements as float32: the row itself for a float32 cache,
// else converted into `buffer`.
template <typename T>
const float* load_row(const T* row, float* buffer, int64_t head_dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = paged_llm_cpu::load(row + d);
    return buffer;
  } else {
    const auto& table = fp8_table<T>();
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = table[row[d].x];
    return buffer;
  }
}

void axpy(float weight, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += weight * x[i];
}

// Asks for `bytes` from `address` to be brought into the cache ahead of their use.
inline void prefetch(const void* address, int64_t bytes) {
  const char* start = static_cast<const char*>(address);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

// Calls visit(row, j) for the cache rows of positions [first, end) of one sequence's KV
// head (j = position - first), a block at a time: no division per position, and each
// block's rows are contiguous. On entering a block it prefetches the next block's rows,
// and this block's rows of `also_prefetch` (the values, while the keys are read).
// NOTE: a block's rows are scattered pages, so the hardware prefetcher stops at every
// block: without these, 3/4 of the kernel's time was loads waiting for memory.
template <typename C, typename Visit>
inline void for_each_row(const C* head, const C* also_prefetch, const int32_t* table,
    int64_t block_stride, int64_t block_size, int64_t head_dim, int64_t first, int64_t end,
    Visit&& visit) {
  int64_t block = first / block_size;
  int64_t offset = first % block_size;
  const int64_t block_bytes = block_size * head_dim * static_cast<int64_t>(sizeof(C));
  for (int64_t pos = first; pos < end; ++block, offset = 0) {
    const int64_t stop = std::min(end, pos + block_size - offset);
    if (stop < end) prefetch(head + table[block + 1] * block_stride, block_bytes);
    if (also_prefetch != nullptr) {
      prefetch(also_prefetch + table[block] * block_stride, block_bytes);
    }
    const C* rows = head + table[block] * block_stride;
    for (; pos < stop; ++pos, ++offset) visit(rows + offset * head_dim, pos - first);
  }
}

#ifdef PAGED_LLM_VECTOR_PASSES
// The caches both vector passes read: 32- and 16-bit floats (fp8 takes the generic loops).
template <typename C>
constexpr bool kVectorCache = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>
    || std::is_same_v<C, c10::Half>;

// Calls process(rows, first, count) for the rows for_each_row visits, kBatch at a time.
template <int64_t kBatch, typename C, typename ForEachRow, typename Process>
void in_batches(ForEachRow&& for_each_row, Process&& process) {
  const C* rows[kBatch];
  int64_t count = 0;
  int64_t first = 0;
  for_each_row([&](const C* row, int64_t) {
    rows[count++] = row;
    if (count == kBatch) {
      process(rows, first, count);
      first += count;
      count = 0;
    }
  });
  if (count > 0) process(rows, first, count);
}
#endif

#if defined(__AVX512F__)
// AVX-512 forms of the two passes over a KV head's rows, for head sizes of whole 16-lane
// vectors and 32/16-bit caches. They add in the generic loops' order (each score a 16-lane
// dot product then sum_lanes' halvings; each output element a running sum over the rows),
// so they give the generic code's results; what changes is that nothing is reduced one
// lane at a time and no accumulator goes through memory. The generic pass 1 spent its
// time on one dependent chain a score (a dot product, then its 4-level reduction) and
// pass 2 on loading and storing accumulators: one layer of 64 decodes x 256 tokens took
// 2.07 ms on a 2-core Zen 5, at 12 GB/s where the caches deliver 58-170.
namespace avx512 {

inline __m512 load16(const float* row) { return _mm512_loadu_ps(row); }

inline __m512 load16(const c10::BFloat16* row) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load16(const c10::Half* row) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
}

// Lane r of the result is sum_lanes(v[r]), added as sum_lanes adds (lane l with l + 8,
// then l + 4, l + 2, l + 1), four levels of shuffles shared by all 16 vectors.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 half[8];
  for (int i = 0; i < 8; ++i) {  // [r=2i lanes 0-7 | r=2i+1 lanes 0-7]: l + (l + 8)
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
        _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  __m512 quarter[4];
  for (int i = 0; i < 4; ++i) {  // 128-bit chunk k holds r = 4i + k: l + (l + 4)
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
        _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
  }
  __m512 eighth[2];
  for (int i = 0; i < 2; ++i) {  // chunk k: r = 8i + k (lanes 0-1), 8i + 4 + k (2-3)
    eighth[i] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0x44),
        _mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0xEE));
  }
  // chunk k: r = k, 4 + k, 8 + k, 12 + k; lane 4k + m holds r = k + 4m.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88),
      _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
  const __m512i order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Scores of `count` (<= 16) keys at positions [first, first + count) for each of the G
// query heads, into scores[g * visible + j], and each head's running maximum.
template <int kChunks, typename C>
void score_keys(const float* queries, int64_t group, const C* const* keys, int64_t count,
    float scale, int64_t first, int64_t visible, float* scores, float* maximum) {
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
  for (int64_t g = 0; g < group; ++g) {
    __m512 query[kChunks];
    for (int c = 0; c < kChunks; ++c) query[c] = _mm512_loadu_ps(queries + g * kChunks * 16 + c * 16);
    __m512 lanes[16];
    for (int r = 0; r < 16; ++r) {
      const C* key = keys[r < count ? r : count - 1];
      lanes[r] = _mm512_mul_ps(query[0], load16(key));
      for (int c = 1; c < kChunks; ++c) {
        lanes[r] = _mm512_fmadd_ps(query[c], load16(key + c * 16), lanes[r]);
      }
    }
    const __m512 score = _mm512_mul_ps(sum_lanes16(lanes), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + g * visible + first, valid, score);
    maximum[g] = std::max(maximum[g],
        _mm512_mask_reduce_max_ps(valid, score));
  }
}

// accumulators[g] = sum over the rows j of weights[g * visible + j] * value_j, for the
// heads [head, head + kHeads): one pass over the rows with the sums held in registers.
template <int kChunks, int kHeads, typename C, typename Rows>
void weigh_values(const float* weights, int64_t head, int64_t visible, Rows&& for_each_value,
    float* accumulators) {
  __m512 sums[kHeads][kChunks];
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) sums[h][c] = _mm512_setzero_ps();
  }
  for_each_value([&](const C* row, int64_t j) {
    __m512 value[kChunks];
    for (int c = 0; c < kChunks; ++c) value[c] = load16(row + c * 16);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 weight = _mm512_set1_ps(weights[(head + h) * visible + j]);
      for (int c = 0; c < kChunks; ++c) sums[h][c] = _mm512_fmadd_ps(weight, value[c], sums[h][c]);
    }
  });
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(accumulators + ((head + h) * kChunks + c) * 16, sums[h][c]);
    }
  }
}

// Heads in tiles of up to 16 accumulator registers (4 heads of 64, 2 of 128).
template <int kChunks, typename C, typename Rows>
void weigh_all_values(const float* weights, int64_t group, int64_t visible, Rows&& for_each_value,
    float* accumulators) {
  constexpr int kTile = 16 / kChunks;
  int64_t head = 0;
  for (; head + kTile <= group; head += kTile) {
    weigh_values<kChunks, kTile, C>(weights, head, visible, for_each_value, accumulators);
  }
  for (; head < group; ++head) {
    weigh_values<kChunks, 1, C>(weights, head, visible, for_each_value, accumulators);
  }
}

// Pass 1 over all of a KV head's keys, 16 at a time.
template <int kChunks, typename C, typename ForEachKey>
void score_all_keys(ForEachKey&& for_each_key, const float* queries, int64_t group, float scale,
    int64_t visible, float* scores, float* maximum) {
  in_batches<16, C>(for_each_key, [&](const C* const* keys, int64_t first, int64_t count) {
    score_keys<kChunks>(queries, group, keys, count, scale, first, visible, scores, maximum);
  });
}

}  // namespace avx512
namespace vector_isa = avx512;
#elif defined(PAGED_LLM_VECTOR_PASSES)
// AVX2 forms of the two passes (Zen 3 and other CPUs without AVX-512), for the same head
// sizes and caches, adding in the same order as the generic loops: a score's 16 partial
// sums are two 8-lane registers, reduced as sum_lanes reduces them; an output element is a
// running sum over the rows. With 16 registers instead of 32, a batch of 8 keys is scored
// at a time, each chunk of a key loaded once for up to 4 query heads, and the values are
// weighed in batches of rows that stay in L1 while every head and column tile passes over
// them (the running sums wait in memory between batches, which rounds nothing). One layer
// of 64 decodes of 600 tokens sharing 448, 2 threads of a Zen 3: 7.4 ms in the generic
// loops, 3.4 here (bfloat16 4.9 / 2.6) with a key loaded once per head; loading each key
// chunk once per tile of heads then took 4-23% off (SmolLM2's 3 heads a KV head, float32,
// least; 8 heads, most), both builds timed alternately in one process.
namespace avx2 {

inline __m256 load8(const float* row) { return _mm256_loadu_ps(row); }

inline __m256 load8(const c10::BFloat16* row) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load8(const c10::Half* row) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
}

constexpr int64_t kKeysPerBatch = 8;
constexpr int64_t kRowsPerBatch = 16;

// Lane r of the result is sum_lanes of key r's 16 partial sums, given as
// folded[r] = lanes l + (l + 8) (sum_lanes' first halving); the other three halvings
// (l + 4, l + 2, l + 1) are shuffles shared by the 8 keys.
inline __m256 sum_lanes8(const __m256* folded) {
  __m256 quarter[4];
  for (int i = 0; i < 4; ++i) {  // 128-bit half k holds key 2i + k: l + (l + 4)
    quarter[i] = _mm256_add_ps(_mm256_permute2f128_ps(folded[2 * i], folded[2 * i + 1], 0x20),
        _mm256_permute2f128_ps(folded[2 * i], folded[2 * i + 1], 0x31));
  }
  __m256 eighth[2];
  for (int i = 0; i < 2; ++i) {  // half k: key 4i + k (lanes 0-1), 4i + 2 + k (lanes 2-3)
    eighth[i] = _mm256_add_ps(_mm256_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0x44),
        _mm256_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0xEE));
  }
  // half k: keys k, 2 + k, 4 + k, 6 + k; lane 4k + m holds key k + 2m.
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(eighth[0], eighth[1], 0x88),
      _mm256_shuffle_ps(eighth[0], eighth[1], 0xDD));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Up to this many query heads are scored together, so that each chunk of a key is
// loaded once for all of them (2 registers of partial sums a head, 2 for the key chunk).
constexpr int kMaxHeadsPerTile = 4;

// folded[h * 8 + r] = sum_lanes' first halving (l + (l + 8)) of the 16 partial sums of
// query head h of the kHeads at `queries` with key r.
template <int kChunks, int kHeads, typename C>
void fold_keys(const float* queries, const C* const* keys, int64_t count, __m256* folded) {
  for (int r = 0; r < kKeysPerBatch; ++r) {
    const C* key = keys[r < count ? r : count - 1];
    __m256 low[kHeads];
    __m256 high[kHeads];
    for (int c = 0; c < kChunks; ++c) {
      const __m256 key_low = load8(key + c * 16);
      const __m256 key_high = load8(key + c * 16 + 8);
      for (int h = 0; h < kHeads; ++h) {
        const float* query = queries + (h * kChunks + c) * 16;
        low[h] = c == 0 ? _mm256_mul_ps(load8(query), key_low)
                        : _mm256_fmadd_ps(load8(query), key_low, low[h]);
        high[h] = c == 0 ? _mm256_mul_ps(load8(query + 8), key_high)
                         : _mm256_fmadd_ps(load8(query + 8), key_high, high[h]);
      }
    }
    for (int h = 0; h < kHeads; ++h) {
      folded[h * kKeysPerBatch + r] = _mm256_add_ps(low[h], high[h]);
    }
  }
}

// Scores of `count` (<= 8) keys at positions [first, first + count) for each of the G
// query heads, into scores[g * visible + j], and each head's running maximum.
template <int kChunks, typename C>
void score_keys(const float* queries, int64_t group, const C* const* keys, int64_t count,
    float scale, int64_t first, int64_t visible, float* scores, float* maximum) {
  __m256 folded[kMaxHeadsPerTile * kKeysPerBatch];
  for (int64_t head = 0; head < group; head += kMaxHeadsPerTile) {
    const int64_t heads = std::min<int64_t>(kMaxHeadsPerTile, group - head);
    const float* tile_queries = queries + head * kChunks * 16;
    switch (heads) {
      case 4:
        fold_keys<kChunks, 4>(tile_queries, keys, count, folded);
        break;
      case 3:
        fold_keys<kChunks, 3>(tile_queries, keys, count, folded);
        break;
      case 2:
        fold_keys<kChunks, 2>(tile_queries, keys, count, folded);
        break;
      default:
        fold_keys<kChunks, 1>(tile_queries, keys, count, folded);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = head + h;
      alignas(32) float score[kKeysPerBatch];
      _mm256_store_ps(score, _mm256_mul_ps(sum_lanes8(folded + h * kKeysPerBatch),
          _mm256_set1_ps(scale)));
      for (int64_t r = 0; r < count; ++r) {
        scores[g * visible + first + r] = score[r];
        maximum[g] = std::max(maximum[g], score[r]);
      }
    }
  }
}

// accumulators[h][column + s * 8 ...] += weights[h * visible + first + r] * rows[r][...] for
// the heads [head, head + kHeads), the 8-float columns s < kSpan and the rows in order.
template <int kHeads, int kSpan, typename C>
void weigh_tile(const float* weights, int64_t head, int64_t column, int64_t head_dim,
    int64_t visible, const C* const* rows, int64_t first, int64_t count, float* accumulators) {
  __m256 sums[kHeads][kSpan];
  for (int h = 0; h < kHeads; ++h) {
    for (int s = 0; s < kSpan; ++s) {
      sums[h][s] = _mm256_loadu_ps(accumulators + (head + h) * head_dim + column + s * 8);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    __m256 value[kSpan];
    for (int s = 0; s < kSpan; ++s) value[s] = load8(rows[r] + column + s * 8);
    for (int h = 0; h < kHeads; ++h) {
      const __m256 weight = _mm256_set1_ps(weights[(head + h) * visible + first + r]);
      for (int s = 0; s < kSpan; ++s) sums[h][s] = _mm256_fmadd_ps(weight, value[s], sums[h][s]);
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int s = 0; s < kSpan; ++s) {
      _mm256_storeu_ps(accumulators + (head + h) * head_dim + column + s * 8, sums[h][s]);
    }
  }
}

// Every head and column tile over one batch of rows: tiles of 2 heads x 32 columns (8
// running sums, 4 values and a weight: 13 of the 16 registers), a last single head alone.
template <typename C>
void weigh_rows(const float* weights, int64_t group, int64_t head_dim, int64_t visible,
    const C* const* rows, int64_t first, int64_t count, float* accumulators) {
  constexpr int kSpan = 4;
  for (int64_t column = 0; column < head_dim; column += kSpan * 8) {
    int64_t head = 0;
    for (; head + 2 <= group; head += 2) {
      weigh_tile<2, kSpan>(weights, head, column, head_dim, visible, rows, first, count,
          accumulators);
    }
    if (head < group) {
      weigh_tile<1, kSpan>(weights, head, column, head_dim, visible, rows, first, count,
          accumulators);
    }
  }
}

template <int kChunks, typename C, typename ForEachKey>
void score_all_keys(ForEachKey&& for_each_key, const float* queries, int64_t group, float scale,
    int64_t visible, float* scores, float* maximum) {
  in_batches<kKeysPerBatch, C>(for_each_key, [&](const C* const* keys, int64_t first,
      int64_t count) {
    score_keys<kChunks>(queries, group, keys, count, scale, first, visible, scores, maximum);
  });
}

template <int kChunks, typename C, typename ForEachValue>
void weigh_all_values(const float* weights, int64_t group, int64_t visible,
    ForEachValue&& for_each_value, float* accumulators) {
  constexpr int64_t kHeadDim = kChunks * 16;
  std::fill(accumulators, accumulators + group * kHeadDim, 0.0f);
  in_batches<kRowsPerBatch, C>(for_each_value, [&](const C* const* rows, int64_t first,
      int64_t count) {
    weigh_rows(weights, group, kHeadDim, visible, rows, first, count, accumulators);
  });
}

}  // namespace avx2
namespace vector_isa = avx2;
#endif

// 16-float chunks (kLanes) in a head where the vector passes (AVX-512 or AVX2) run (4 or
// 8), else 0.
template <typename C>
int64_t vector_chunks_for(int64_t head_dim) {
#ifdef PAGED_LLM_VECTOR_PASSES
  if constexpr (kVectorCache<C>) {
    if (head_dim == 64 || head_dim == 128) return head_dim / 16;
  }
#endif
  return 0;
}

// Pass 1: scores[g * visible + j] = scale * q_g . k_j, and each head's maximum.
template <typename C, typename ForEachKey>
void score_keys(int64_t vector_chunks, ForEachKey&& for_each_key, const float* queries,
    int64_t group, int64_t head_dim, float scale, int64_t visible, float* scores,
    float* maximum, float* row_buffer) {
#ifdef PAGED_LLM_VECTOR_PASSES
  if constexpr (kVectorCache<C>) {
    if (vector_chunks == 4) {
      return vector_isa::score_all_keys<4, C>(for_each_key, queries, group, scale, visible,
          scores, maximum);
    }
    if (vector_chunks == 8) {
      return vector_isa::score_all_keys<8, C>(for_each_key, queries, group, scale, visible,
          scores, maximum);
    }
  }
#endif
  for_each_key([&](const C* k_row, int64_t j) {
    const float* key = load_row(k_row, row_buffer, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float score = dot(queries + g * head_dim, key, head_dim) * scale;
      scores[g * visible + j] = score;
      maximum[g] = std::max(maximum[g], score);
    }
  });
}

// The value pass: accumulators[g] = sum over j of weights[g * visible + j] * v_j.
template <typename C, typename ForEachValue>
void weigh_values(int64_t vector_chunks, ForEachValue&& for_each_value, const float* weights,
    int64_t group, int64_t head_dim, int64_t visible, float* accumulators, float* row_buffer) {
#ifdef PAGED_LLM_VECTOR_PASSES
  if constexpr (kVectorCache<C>) {
    if (vector_chunks == 4) {
      return vector_isa::weigh_all_values<4, C>(weights, group, visible, for_each_value,
          accumulators);
    }
    if (vector_chunks == 8) {
      return vector_isa::weigh_all_values<8, C>(weights, group, visible, for_each_value,
          accumulators);
    }
  }
#endif
  std::fill(accumulators, accumulators + group * head_dim, 0.0f);
  for_each_value([&](const C* v_row, int64_t j) {
    const float* value = load_row(v_row, row_buffer, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      axpy(weights[g * visible + j], value, accumulators + g * head_dim, head_dim);
    }
  });
}

template <typename Q, typename C>
void decode_attention_impl(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& token_idx,
    const at::Tensor& seq_idx,
    const at::Tensor& context_lens,
    double scale,
    int64_t sliding_window,
    bool vector_passes,
    at::Tensor& out) {
  const int64_t num_tokens = token_idx.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0);
  const int64_t block_size = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_token_stride = query.stride(0);
  const int64_t out_token_stride = out.stride(0);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t head_stride = key_cache.stride(0);  // the caches are contiguous
  const int64_t block_stride = key_cache.stride(1);

  const Q* q_data = query.const_data_ptr<Q>();
  Q* out_data = out.data_ptr<Q>();
  const C* k_data = static_cast<const C*>(key_cache.const_data_ptr());
  const C* v_data = static_cast<const C*>(value_cache.const_data_ptr());
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t* tokens = token_idx.const_data_ptr<int64_t>();
  const int64_t* seqs = seq_idx.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const float softmax_scale = static_cast<float>(scale);
  const int64_t vector_chunks = vector_passes ? vector_chunks_for<C>(head_dim) : 0;

  // A task's work is its context length; a few per thread even out the lengths. Tasks go
  // KV head by KV head, so a thread's consecutive tasks read the same head's rows: a prefix
  // their sequences share stays in L2 between them (2-5% off a layer of 64 decodes sharing
  // 448 of 600 tokens, measured against token by token).
  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * head_dim);
    std::vector<float> accumulators(group * head_dim);
    std::vector<float> row_buffer(head_dim);
    std::vector<float> scores;
    std::vector<float> maximum(group);
    std::vector<float> total(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_head = task / num_tokens;
      const int64_t n = task % num_tokens;
      const int64_t token = tokens[n];
      const int64_t context_len = lens[n];
      const int64_t first = sliding_window > 0
          ? std::max<int64_t>(0, context_len - sliding_window) : 0;
      const int64_t visible = context_len - first;
      const int32_t* table = tables + seqs[n] * table_stride;
      const C* k_head = k_data + kv_head * head_stride;
      const C* v_head = v_data + kv_head * head_stride;
      const Q* q_row = q_data + token * q_token_stride + kv_head * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) queries[i] = paged_llm_cpu::load(q_row + i);
      scores.resize(group * visible);

      const auto for_each_key = [&](auto&& visit) {
        for_each_row(k_head, v_head, table, block_stride, block_size, head_dim, first,
            context_len, visit);
      };
      const auto for_each_value = [&](auto&& visit) {
        for_each_row(v_head, static_cast<const C*>(nullptr), table, block_stride, block_size,
            head_dim, first, context_len, visit);
      };
      // Pass 1: scores [G, visible] and their maximum per head.
      std::fill(maximum.begin(), maximum.end(), -std::numeric_limits<float>::infinity());
      score_keys<C>(vector_chunks, for_each_key, queries.data(), group, head_dim, softmax_scale,
          visible, scores.data(), maximum.data(), row_buffer.data());
      // Pass 2: exp(score - max) in place, the weighted sum of the values, the total.
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * visible;
        const float row_maximum = maximum[g];
        for (int64_t j = 0; j < visible; ++j) row[j] = exp_clamped(row[j] - row_maximum);
        total[g] = sum(row, visible);
      }
      weigh_values<C>(vector_chunks, for_each_value, scores.data(), group, head_dim, visible,
          accumulators.data(), row_buffer.data());
      Q* out_row = out_data + token * out_token_stride + kv_head * group * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float factor = 1.0f / total[g];
        for (int64_t d = 0; d < head_dim; ++d) {
          paged_llm_cpu::store(out_row + g * head_dim + d, accumulators[g * head_dim + d] * factor);
        }
      }
    }
  });
}

// The cache holds the query's dtype, or fp8 bytes.
template <typename Q>
void dispatch_cache(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& token_idx, const at::Tensor& seq_idx,
    const at::Tensor& context_lens, double scale, int64_t sliding_window, bool vector_passes,
    at::Tensor& out) {
  const auto run = [&](auto cache_element) {
    decode_attention_impl<Q, decltype(cache_element)>(query, key_cache, value_cache,
        block_tables, token_idx, seq_idx, context_lens, scale, sliding_window, vector_passes,
        out);
  };
  if (key_cache.scalar_type() == query.scalar_type()) return run(Q{});
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return run(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2:
      return run(c10::Float8_e5m2{});
    default:
      TORCH_CHECK(false, "decode_attention: a ", query.scalar_type(), " query cannot read a ",
          key_cache.scalar_type(), " cache");
  }
}

// The Python wrapper (csrc_cpu/__init__.py) checks shapes and dtypes; these checks only
// guard the memory this code reads and writes.
void decode_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& token_idx, const at::Tensor& seq_idx,
    const at::Tensor& context_lens, double scale, int64_t sliding_window, bool vector_passes,
    at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
      "decode_attention: query must be [T, H, D] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1
      && out.stride(1) == out.size(2), "decode_attention: out must be shaped like query");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous()
      && key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 4
      && key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(0) == 0,
      "decode_attention: caches must be contiguous [Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
      "decode_attention: block_tables must be int32 with contiguous rows");
  TORCH_CHECK(token_idx.scalar_type() == at::kLong && seq_idx.scalar_type() == at::kLong
      && context_lens.scalar_type() == at::kLong && token_idx.is_contiguous()
      && seq_idx.is_contiguous() && context_lens.is_contiguous()
      && seq_idx.size(0) == token_idx.size(0) && context_lens.size(0) == token_idx.size(0),
      "decode_attention: token_idx, seq_idx, context_lens must be contiguous int64 [N]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(),
      "decode_attention: out must have the query's dtype");
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(query, key_cache, value_cache, block_tables, token_idx,
          seq_idx, context_lens, scale, sliding_window, vector_passes, out);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(query, key_cache, value_cache, block_tables,
          token_idx, seq_idx, context_lens, scale, sliding_window, vector_passes, out);
    case at::kHalf:
      return dispatch_cache<c10::Half>(query, key_cache, value_cache, block_tables, token_idx,
          seq_idx, context_lens, scale, sliding_window, vector_passes, out);
    default:
      TORCH_CHECK(false, "decode_attention: unsupported query dtype ", query.scalar_type());
  }
}

// Whether decodes of this head size over a cache of this dtype take the vector passes:
// the one answer `decode_attention_impl` acts on (`vector_chunks_for`), asked by the Python
// side to decide whether sharing decodes take the cascade.
bool vectorized_decode_attention(int64_t head_dim, at::ScalarType cache_dtype) {
  switch (cache_dtype) {
    case at::kFloat:
      return vector_chunks_for<float>(head_dim) > 0;
    case at::kBFloat16:
      return vector_chunks_for<c10::BFloat16>(head_dim) > 0;
    case at::kHalf:
      return vector_chunks_for<c10::Half>(head_dim) > 0;
    case at::kFloat8_e4m3fn:
      return vector_chunks_for<c10::Float8_e4m3fn>(head_dim) > 0;
    case at::kFloat8_e5m2:
      return vector_chunks_for<c10::Float8_e5m2>(head_dim) > 0;
    default:
      return false;
  }
}

}  // namespace

TORCH_LIBRARY(paged_llm_cpu, m) {
  m.def("vectorized_decode_attention(int head_dim, ScalarType cache_dtype) -> bool");
  m.impl("vectorized_decode_attention", c10::DispatchKey::CatchAll, &vectorized_decode_attention);
  m.def(
      "decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor token_idx, Tensor seq_idx, Tensor context_lens, "
      "float scale, int sliding_window, bool vector_passes, Tensor(a!) out) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
