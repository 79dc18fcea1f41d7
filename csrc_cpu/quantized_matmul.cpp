// Matmul by a group-quantized weight on CPU, with the activations quantized to int8 per
// block of features and integer dot products (llama.cpp's route for its Q4 / Q8 types,
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
// blocks in the order [row block][feature block]; scales and offsets [row block][group][16],
// float32, or float16 where every one is exact in it (GGUF's Q4_0, Q4_1 and Q8_0 store theirs
// so): a sixth of a 4-bit weight's bytes less to read, widened to float32 once per row
// block into the task's buffer. Rows are padded to a multiple of 16 and features (below)
// with zero codes.
//
// Each activation row is quantized per block of A features (the caller's act_block: 32 for
// group-quantized weights, a multiple of 64 for weights of one group a row; a row's last
// block may be shorter) to int8 codes q with a float32 scale d:
//   d = amax / 127,  q = nearbyint(x * (127 / amax))  (0 where amax is 0), and
//   out[m, n] = sum over spans of (scale * d) * (integer sum of code * q over the span)
//             + sum_g offset[n, g] * (sum over k in g of d * q_k)
// where a span is one group and one activation block: 32 features (16 for groups of 16),
// or A for weights of one group a row. Features are padded to 32 (64 where A is larger,
// AMX's widest tile step) and a span ends there at the latest.
// The integer sums are exact; the passes differ only in the order of float32 additions.
//
// Passes: AMX (tile products of 16 activation rows by 16 output rows by up to 64 features,
// from kAmxMinRows rows, kAmxMinRowsNibbles for 4-bit codes; the VNNI pass below), AVX-512
// with VNNI (vpdpbusd: 64 byte products per instruction; 8-bit codes are made unsigned by
// adding 128, and 128 times the activations' sum is taken off) and AVX2 (vpmaddubsw +
// vpmaddwd; 8-bit codes move their sign onto the activation, so the products fit 16 bits);
// generic loops everywhere else.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "convert.h"

namespace {

enum Isa : int64_t { kGeneric = 0, kAvx2 = 1, kAvx512Vnni = 2, kAmx = 3 };

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define PAGED_LLM_AMX 1
#endif

constexpr int64_t kRowsPerBlock = 16;  // output rows of one packed block (a vector's lanes)
constexpr int64_t kActBlock = 32;  // activation features that share one scale, group-quantized weights
constexpr int64_t kAmxStep = 64;  // features of one AMX tile product at its widest (64 bytes a row)
constexpr int64_t kBlockBytes = 64;
constexpr int64_t kAmxRows = 16;  // activation rows of one AMX tile (its row count)
// Multiply-adds per parallel task: a decode step's matmul by a small projection still
// splits over the cores, where torch's grain (32768 elements) would keep it on one.
constexpr int64_t kMacsPerTask = 1 << 16;
// Activation rows a task multiplies by all its row blocks before the next ones
// (matmul_impl): a multiple of every pass's tile rows (AMX 16 and 32, AVX-512 6 and 8,
// AVX2 2, generic 4), so that only a matmul's last tile is short.
constexpr int64_t kRowChunk = 96;

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
    case kAmx:
#if defined(PAGED_LLM_AMX)
      return true;
#else
      return false;
#endif
  }
  return false;
}

// Linux hands a process AMX's tile registers only once it asks (they add 8 KiB to every
// context switch); without that, the first tile instruction is SIGILL.
bool amx_permitted() {
#if defined(PAGED_LLM_AMX) && defined(__linux__)
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;  // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

bool runnable(Isa isa) { return compiled(isa) && (isa != kAmx || amx_permitted()); }

struct Problem {
  int64_t rows;  // M
  int64_t padded_rows;  // M, rounded up to a tile of activation rows where the pass loads whole tiles
  int64_t out_features;  // N
  int64_t in_features;  // K
  int64_t padded_features;  // K rounded up to kActBlock, or to kAmxStep where act_block is larger
  int64_t group_size;  // >= K: one group a row
  int64_t num_groups;
  int64_t act_block;  // features that share one activation scale
  int64_t act_blocks;  // of a padded row
  int64_t span;  // features of one integer sum: act_block, or 16 for groups of 16
  int64_t spans;  // of a padded row, the last one possibly shorter
  bool nibbles;
  bool has_offset;
  Isa isa;
  int64_t row_blocks;
  int64_t block_stride;  // bytes of one row block's codes
};

// Activation codes start on a cache line, so that each row of an AMX tile load (64 bytes
// at a multiple of 64) reads one line, not two: with new[]'s 16-byte alignment, the pass took
// 1.4x the time at 2,048 rows.
constexpr std::align_val_t kCodeAlignment{64};
struct AlignedCodesDelete {
  void operator()(int8_t* codes) const { ::operator delete[](codes, kCodeAlignment); }
};

// The activations as the passes read them.
struct QuantizedActivations {
  std::unique_ptr<int8_t[], AlignedCodesDelete> q;  // [padded M, padded K], zero past M and K
  std::vector<float> scale;  // [M, act blocks]
  std::vector<int32_t> span_sums;  // [M, spans]: sum of q (8-bit codes off AMX only)
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }

inline __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// `quantize_row` for one block of 16 * halves features, with the same codes: the amax and
// the products are the scalar loop's, and the clamp comes before the rounding (127 is an
// integer), vminps's operand order sending NaN to 127 as std::min does. Writes the codes'
// sum of each span of 16 * span_halves features (the last one possibly shorter) to
// span_sums, if not null: one horizontal sum a span, not one per 16 features.
template <typename T>
inline void quantize_block(
    const T* row, int64_t halves, int64_t span_halves, int8_t* q, float* scale, int32_t* span_sums) {
  // vmaxps returns its second operand where either is NaN: NaN is skipped, as in std::max.
  __m512 magnitude = _mm512_setzero_ps();
  for (int64_t h = 0; h < halves; ++h) magnitude = _mm512_max_ps(_mm512_abs_ps(load16(row + 16 * h)), magnitude);
  const float amax = _mm512_reduce_max_ps(magnitude);
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  *scale = amax / 127.0f;
  const __m512 high = _mm512_set1_ps(127.0f), low = _mm512_set1_ps(-127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t h = 0; h < halves; ++h) {
    const __m512 x = _mm512_mul_ps(load16(row + 16 * h), inverse);
    const __m512i codes = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(x, high), low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(codes));
    if (span_sums != nullptr) {
      sum = _mm512_add_epi32(sum, codes);
      if ((h + 1) % span_halves == 0 || h + 1 == halves) {
        span_sums[h / span_halves] = _mm512_reduce_add_epi32(sum);
        sum = _mm512_setzero_si512();
      }
    }
  }
}
#endif

// One activation row: its codes and block scales, the codes' sum over each span (8-bit
// weight codes off AMX only) and the sum of d * q over each group (weights with offsets
// only). `sums` (p.spans entries, the caller's, reused row after row) holds the span sums
// where span_sums is null. A span lies in one activation block and one group.
template <typename T>
void quantize_activation_row(const Problem& p, const T* x, int8_t* q, float* scales,
    int32_t* span_sums, float* group_sums, int32_t* sums) {
  const int64_t K = p.in_features, Kp = p.padded_features, A = p.act_block, S = p.span;
  std::fill(q + K, q + Kp, 0);
  const bool summed = span_sums != nullptr || group_sums != nullptr;
  int32_t* spans = span_sums != nullptr ? span_sums : sums;
  if (summed) std::fill(spans, spans + p.spans, 0);
  for (int64_t b = 0; b * A < K; ++b) {
    const int64_t start = b * A, size = std::min(K - start, A);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (size % kActBlock == 0) {
      quantize_block(x + start, size / 16, S / 16, q + start, scales + b, summed ? spans + start / S : nullptr);
      continue;
    }
#endif
    quantize_row(x + start, size, A, q + start, scales + b);
    if (summed) {
      for (int64_t k = start; k < start + size; ++k) spans[k / S] += q[k];
    }
  }
  if (group_sums != nullptr) {
    for (int64_t s = 0; s < p.spans; ++s) {
      const int64_t g = std::min(s * S / p.group_size, p.num_groups - 1);
      group_sums[g] += scales[s * S / A] * static_cast<float>(spans[s]);
    }
  }
}

// Activation rows from which the AMX pass takes a matmul: it computes whole tiles of 16
// rows, and below these the VNNI pass's tiles of the rows there are were as fast or faster
// (SmolLM2's gate_up and down, 2 threads, us AMX / VNNI: int8 at 12 rows 66 / 79 and
// 43 / 51; Q4_1, whose codes AMX unpacks first, at 32 rows 188 / 195 and 136 / 122, at
// 48 rows 282 / 276 and 172 / 170, at 64 rows 351 / 378 and 200 / 222).
constexpr int64_t kAmxMinRows = 12;
constexpr int64_t kAmxMinRowsNibbles = 48;

bool uses_amx(const Problem& p) {
  return p.isa == kAmx && p.rows >= (p.nibbles ? kAmxMinRowsNibbles : kAmxMinRows);
}

template <typename T>
QuantizedActivations quantize_activations(const Problem& p, const T* x, int64_t x_stride) {
  const int64_t M = p.rows, Kp = p.padded_features, padded = p.padded_rows;
  QuantizedActivations a;
  // NOTE: not zero-filled whole (a tenth of the time of quantizing 1,024 rows): the rows
  // write their codes and zero their padding, and the padded rows are zeroed here.
  a.q.reset(static_cast<int8_t*>(::operator new[](padded * Kp, kCodeAlignment)));
  std::fill(a.q.get() + M * Kp, a.q.get() + padded * Kp, 0);
  a.scale.assign(padded * p.act_blocks, 0.0f);
  // Only the VNNI and AVX2 passes' unsigned 8-bit codes need the activations' sums; AMX
  // multiplies signed codes as they are.
  const bool span_sums = !p.nibbles && !uses_amx(p);
  if (span_sums) a.span_sums.resize(padded * p.spans);
  if (p.has_offset) a.group_sums.assign(padded * p.num_groups, 0.0f);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / Kp), [&](int64_t m0, int64_t m1) {
    std::vector<int32_t> sums(p.spans);
    for (int64_t m = m0; m < m1; ++m) {
      quantize_activation_row(p, x + m * x_stride, a.q.get() + m * Kp, a.scale.data() + m * p.act_blocks,
          span_sums ? a.span_sums.data() + m * p.spans : nullptr,
          p.has_offset ? a.group_sums.data() + m * p.num_groups : nullptr, sums.data());
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

// Where the span starting at feature k0 ends.
inline int64_t span_end(const Problem& p, int64_t k0) { return std::min(k0 + p.span, p.padded_features); }

// out[m0 + t, n0 + l] for t < tile, l < 16, into result[t * 16 + l].
void generic_tile(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t tile, float* result) {
  const int64_t Kp = p.padded_features;
  for (int64_t t = 0; t < tile; ++t) {
    const int8_t* q = a.q.get() + (m0 + t) * Kp;
    const float* d = a.scale.data() + (m0 + t) * p.act_blocks;
    for (int64_t lane = 0; lane < kRowsPerBlock; ++lane) {
      float total = 0.0f;
      for (int64_t k0 = 0; k0 < Kp; k0 += p.span) {
        int32_t sum = 0;
        for (int64_t k = k0; k < span_end(p, k0); ++k) sum += packed_code(codes, p.nibbles, lane, k) * q[k];
        total += scale[group_of(p, k0) * kRowsPerBlock + lane] * d[k0 / p.act_block] * static_cast<float>(sum);
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
      q[t] = a.q.get() + (m0 + t) * p.padded_features;
      d[t] = a.scale.data() + (m0 + t) * p.act_blocks;
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// kTile activation rows by kBlocks consecutive row blocks (16 output rows each): a
// broadcast of 4 activation bytes feeds kBlocks vpdpbusd, so two blocks halve the
// broadcasts per product, which bound one block's loop (one load per vpdpbusd).
template <bool kNibbles, int kTile, int kBlocks>
void avx512_tile(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, float* result) {
  const int64_t Kp = p.padded_features, S = p.span, group_stride = p.num_groups * kRowsPerBlock;
  const TileRows<kTile> rows(p, a, m0);
  const int8_t* const* q = rows.q;
  const float* const* d = rows.d;
  __m512 acc[kTile][kBlocks];
  for (int t = 0; t < kTile; ++t) {
    for (int j = 0; j < kBlocks; ++j) acc[t][j] = _mm512_setzero_ps();
  }
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i sign_flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k0 = 0; k0 < Kp; k0 += S) {
    __m512i sums[kTile][kBlocks];
    for (int t = 0; t < kTile; ++t) {
      for (int j = 0; j < kBlocks; ++j) sums[t][j] = _mm512_setzero_si512();
    }
    if constexpr (kNibbles) {
      for (int64_t k = k0; k < span_end(p, k0); k += 8) {
        __m512i low[kBlocks], high[kBlocks];
        for (int j = 0; j < kBlocks; ++j) {
          const __m512i w = _mm512_loadu_si512(codes + j * p.block_stride + (k / 8) * kBlockBytes);
          low[j] = _mm512_and_si512(w, low_mask);
          high[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low_mask);
        }
        for (int t = 0; t < kTile; ++t) {
          const __m512i x_low = _mm512_set1_epi32(four_bytes(q[t] + k));
          const __m512i x_high = _mm512_set1_epi32(four_bytes(q[t] + k + 4));
          for (int j = 0; j < kBlocks; ++j) {
            sums[t][j] = _mm512_dpbusd_epi32(sums[t][j], low[j], x_low);
            sums[t][j] = _mm512_dpbusd_epi32(sums[t][j], high[j], x_high);
          }
        }
      }
    } else {
      for (int64_t k = k0; k < span_end(p, k0); k += 4) {
        __m512i w[kBlocks];
        for (int j = 0; j < kBlocks; ++j) {
          w[j] = _mm512_xor_si512(_mm512_loadu_si512(codes + j * p.block_stride + (k / 4) * kBlockBytes), sign_flip);
        }
        for (int t = 0; t < kTile; ++t) {
          const __m512i x = _mm512_set1_epi32(four_bytes(q[t] + k));
          for (int j = 0; j < kBlocks; ++j) sums[t][j] = _mm512_dpbusd_epi32(sums[t][j], w[j], x);
        }
      }
      for (int t = 0; t < kTile; ++t) {
        const __m512i correction = _mm512_set1_epi32(128 * a.span_sums[(m0 + t) * p.spans + k0 / S]);
        for (int j = 0; j < kBlocks; ++j) sums[t][j] = _mm512_sub_epi32(sums[t][j], correction);
      }
    }
    __m512 s[kBlocks];
    for (int j = 0; j < kBlocks; ++j) s[j] = _mm512_loadu_ps(scale + j * group_stride + group_of(p, k0) * kRowsPerBlock);
    for (int t = 0; t < kTile; ++t) {
      const __m512 dt = _mm512_set1_ps(d[t][k0 / p.act_block]);
      for (int j = 0; j < kBlocks; ++j) {
        acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][j]), _mm512_mul_ps(s[j], dt), acc[t][j]);
      }
    }
  }
  if (offset != nullptr) {
    for (int64_t g = 0; g < p.num_groups; ++g) {
      for (int j = 0; j < kBlocks; ++j) {
        const __m512 o = _mm512_loadu_ps(offset + j * group_stride + g * kRowsPerBlock);
        for (int t = 0; t < kTile; ++t) {
          acc[t][j] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.group_sums[(m0 + t) * p.num_groups + g]), acc[t][j]);
        }
      }
    }
  }
  for (int t = 0; t < kTile; ++t) {
    for (int j = 0; j < kBlocks; ++j) _mm512_storeu_ps(result + (t * kBlocks + j) * kRowsPerBlock, acc[t][j]);
  }
}
#endif

#if defined(PAGED_LLM_AMX)
// AMX: one tile instruction multiplies 16 activation rows by up to 64 features of codes for
// 16 output rows (16 x 16 x 64 byte products), where vpdpbusd does 16 x 4; a span of more
// features takes several into one sum tile. The packed 8-bit layout is already AMX's B
// operand (row r: 16 outputs x features 4r..4r+3); 4-bit codes are unpacked to it once per
// row block and thread. Integer sums leave the tiles each span, to be scaled by that
// span's activation and weight scales with AVX-512, as in the VNNI pass. amx_tile keeps four
// spans in flight (sum tiles 0-3), since one span's chain of tile instructions, store and
// scaling left the tile unit idle most of the time; amx_tile_pair takes two row blocks.
constexpr int64_t kAmxSpansInFlight = 4;

// A thread's 4-bit codes unpacked to AMX's B rows, and the row block they came from: one
// slot for each row block a tile takes.
struct AmxScratch {
  const uint8_t* unpacked_from[2] = {};
  std::vector<uint8_t> unpacked[2];
};
thread_local AmxScratch amx_scratch;

// Features of one tile product: the span, up to a tile's 64 bytes a row.
inline int64_t amx_step(const Problem& p) { return std::min(p.span, kAmxStep); }

// The tile shapes for products of amx_step features: sums 0-3, activations 4-5, codes
// 6-7. Tile configuration is per thread; each task sets it.
void amx_configure(const Problem& p) {
  struct alignas(64) {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int tile = 0; tile < 4; ++tile) {
    config.rows[tile] = kAmxRows;
    config.bytes_per_row[tile] = kRowsPerBlock * sizeof(int32_t);
  }
  for (int tile = 4; tile < 6; ++tile) {
    config.rows[tile] = kAmxRows;
    config.bytes_per_row[tile] = static_cast<uint16_t>(amx_step(p));
  }
  for (int tile = 6; tile < 8; ++tile) {
    config.rows[tile] = static_cast<uint8_t>(amx_step(p) / 4);
    config.bytes_per_row[tile] = kBlockBytes;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes, so the stores to the rest
  // of the configuration would be dropped as dead without this barrier.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
  // The weight's memory may since hold another.
  std::fill(std::begin(amx_scratch.unpacked_from), std::end(amx_scratch.unpacked_from), nullptr);
}

void amx_release() { _tile_release(); }

// A row block's 4-bit codes in the 8-bit layout (AMX's B rows), from this thread's scratch.
const uint8_t* amx_unpacked(const Problem& p, const uint8_t* codes, int slot) {
  const uint8_t*& unpacked_from = amx_scratch.unpacked_from[slot];
  std::vector<uint8_t>& unpacked = amx_scratch.unpacked[slot];
  if (unpacked_from != codes) {
    unpacked.resize(p.padded_features * kRowsPerBlock);
    const __m512i low_mask = _mm512_set1_epi8(0x0F);
    for (int64_t i = 0; i < p.padded_features / 8; ++i) {
      const __m512i w = _mm512_loadu_si512(codes + i * kBlockBytes);
      uint8_t* rows = unpacked.data() + 2 * i * kBlockBytes;
      _mm512_storeu_si512(rows, _mm512_and_si512(w, low_mask));
      _mm512_storeu_si512(rows + kBlockBytes, _mm512_and_si512(_mm512_srli_epi16(w, 4), low_mask));
    }
    unpacked_from = codes;
    // GCC's tile loads do not tell the compiler they read memory: the stores above stay first.
    asm volatile("" : : : "memory");
  }
  return unpacked.data();
}

// Sum tile `sum` += activation rows (tile `act`) times codes (tile `code`). Tile numbers
// are pasted into the assembly: literals only.
#define PAGED_LLM_AMX_PRODUCT(sum, act, code)                                \
  do {                                                                       \
    if constexpr (kNibbles) {                                                \
      _tile_dpbsud(sum, act, code); /* signed activations, unsigned codes */ \
    } else {                                                                 \
      _tile_dpbssd(sum, act, code);                                          \
    }                                                                        \
  } while (false)

// Sum tile `sum` = activation rows (tile `act`) times the span's codes (tile `code`) of
// the span at feature `k`.
#define PAGED_LLM_AMX_SPAN(sum, act, code, k)                        \
  do {                                                               \
    _tile_zero(sum);                                                 \
    for (int64_t f = (k); f < span_end(p, (k)); f += step) {         \
      _tile_loadd(act, q + f, Kp);                                   \
      _tile_loadd(code, weights + f * kBlockBytes / 4, kBlockBytes); \
      PAGED_LLM_AMX_PRODUCT(sum, act, code);                         \
    }                                                                \
  } while (false)

// Rows m0 .. m0 + 16 (past M: zero codes and scales) by one row block; `tile` is unused.
template <bool kNibbles>
void amx_tile(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t /*tile*/, float* result) {
  const int64_t Kp = p.padded_features, S = p.span, step = amx_step(p);
  alignas(64) int32_t sums[kAmxSpansInFlight][kAmxRows * kRowsPerBlock];
  const uint8_t* weights = kNibbles ? amx_unpacked(p, codes, 0) : codes;
  const int8_t* q = a.q.get() + m0 * Kp;
  const float* d = a.scale.data() + m0 * p.act_blocks;
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  const auto scale_span = [&](const int32_t* span_sums, int64_t k0) {
    const __m512 s = _mm512_loadu_ps(scale + group_of(p, k0) * kRowsPerBlock);
    for (int r = 0; r < kAmxRows; ++r) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(d[r * p.act_blocks + k0 / p.act_block]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(span_sums + r * kRowsPerBlock)), sd, acc[r]);
    }
  };
  constexpr int64_t kSumRowBytes = kRowsPerBlock * sizeof(int32_t);
  int64_t k0 = 0;
  for (; k0 + kAmxSpansInFlight * S <= Kp; k0 += kAmxSpansInFlight * S) {
    PAGED_LLM_AMX_SPAN(0, 4, 6, k0);
    PAGED_LLM_AMX_SPAN(1, 5, 7, k0 + S);
    PAGED_LLM_AMX_SPAN(2, 4, 6, k0 + 2 * S);
    PAGED_LLM_AMX_SPAN(3, 5, 7, k0 + 3 * S);
    _tile_stored(0, sums[0], kSumRowBytes);
    _tile_stored(1, sums[1], kSumRowBytes);
    _tile_stored(2, sums[2], kSumRowBytes);
    _tile_stored(3, sums[3], kSumRowBytes);
    for (int64_t i = 0; i < kAmxSpansInFlight; ++i) scale_span(sums[i], k0 + i * S);
  }
  for (; k0 < Kp; k0 += S) {
    PAGED_LLM_AMX_SPAN(0, 4, 6, k0);
    _tile_stored(0, sums[0], kSumRowBytes);
    scale_span(sums[0], k0);
  }
  if (offset != nullptr) {
    for (int64_t g = 0; g < p.num_groups; ++g) {
      const __m512 o = _mm512_loadu_ps(offset + g * kRowsPerBlock);
      for (int r = 0; r < kAmxRows; ++r) {
        acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.group_sums[(m0 + r) * p.num_groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < kAmxRows; ++r) _mm512_storeu_ps(result + r * kRowsPerBlock, acc[r]);
}

// Rows m0 .. m0 + 32 (past M: zero codes and scales) by two row blocks, into result
// [32 rows][32 outputs]: sum tiles 0-3 take rows 0-15 and 16-31 (activation tiles 4, 5)
// by blocks 0 and 1 (code tiles 6, 7), so each tile loaded feeds two products, where
// amx_tile's feed one (leaving its code loads out cut its time by a third). There being no
// registers for 32 x 32 float sums, they live in `result`. Scaling a span's integer sums
// into them costs as much as the span's products (64 features), so the two overlap: a
// span's sums leave the tiles for one of two buffers, and while the tile unit multiplies
// the next span, the vector unit scales them, a quarter of the rows after each of that
// span's first four products (each quarter's instructions within reach of the reorder
// window: scaled in one run after the products, or four spans at a time, the tile unit
// sat idle; SmolLM2's down projection at 2,048 rows, one thread: 42, 33 and 28 ns a tile
// product). Spans here are 64 features or more, so the weight has one group a row
// (`packed_quantized_matmul`): one scale and offset a row.
template <bool kNibbles>
void amx_tile_pair(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t /*tile*/, float* result) {
  constexpr int64_t kRows = 2 * kAmxRows, kOutputs = 2 * kRowsPerBlock, kQuarter = kRows / 4;
  const int64_t Kp = p.padded_features, S = p.span, step = amx_step(p), group_stride = p.num_groups * kRowsPerBlock;
  const uint8_t* w0 = kNibbles ? amx_unpacked(p, codes, 0) : codes;
  const uint8_t* w1 = kNibbles ? amx_unpacked(p, codes + p.block_stride, 1) : codes + p.block_stride;
  const int8_t* q0 = a.q.get() + m0 * Kp;
  const int8_t* q1 = q0 + kAmxRows * Kp;
  const float* d = a.scale.data() + m0 * p.act_blocks;
  // sums[span % 2][2 * half + j]: rows 16 * half .. 16 * half + 15 by row block j.
  alignas(64) int32_t sums[2][4][kAmxRows * kRowsPerBlock];
  constexpr int64_t kSumRowBytes = kRowsPerBlock * sizeof(int32_t);
  // Span `span`'s sums (a span here is one activation block), rows of `quarter`, times the
  // weight's and the block's scales, into `result` (the first span's in place of what it
  // held). The weight's scale multiplies each span's sum, not the total, so the float32
  // sums are the other passes' to the bit. Applied once to the total they were as close to
  // the float64 product (4.1e-9 of its magnitude on average against 4.2e-9) and as fast,
  // but flipped codes downstream: SmolLM2's perplexity with bfloat16 activations read
  // +2.27% on the 562-token text instead of +1.15%, the measure's noise.
  const __m512 weight_scales[2] = {_mm512_loadu_ps(scale), _mm512_loadu_ps(scale + group_stride)};
  const auto scale_quarter = [&](int64_t span, int quarter) {
    const int32_t(*span_sums)[kAmxRows * kRowsPerBlock] = sums[span % 2];
    for (int64_t row = quarter * kQuarter; row < (quarter + 1) * kQuarter; ++row) {
      const __m512 row_scale = _mm512_set1_ps(d[row * p.act_blocks + span]);
      for (int j = 0; j < 2; ++j) {
        const __m512 sum = _mm512_cvtepi32_ps(
            _mm512_load_si512(span_sums[2 * (row / kAmxRows) + j] + row % kAmxRows * kRowsPerBlock));
        const __m512 sd = _mm512_mul_ps(weight_scales[j], row_scale);
        float* acc = result + row * kOutputs + j * kRowsPerBlock;
        _mm512_storeu_ps(acc, span == 0 ? _mm512_mul_ps(sum, sd) : _mm512_fmadd_ps(sum, sd, _mm512_loadu_ps(acc)));
      }
    }
  };
  const int64_t spans = (Kp + S - 1) / S;
  for (int64_t span = 0; span < spans; ++span) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t k0 = span * S;
    for (int64_t f = k0; f < span_end(p, k0); f += step) {
      const bool scale_previous = f == k0 && span > 0;
      _tile_loadd(4, q0 + f, Kp);
      _tile_loadd(6, w0 + f * kBlockBytes / 4, kBlockBytes);
      PAGED_LLM_AMX_PRODUCT(0, 4, 6);
      if (scale_previous) scale_quarter(span - 1, 0);
      _tile_loadd(7, w1 + f * kBlockBytes / 4, kBlockBytes);
      PAGED_LLM_AMX_PRODUCT(1, 4, 7);
      if (scale_previous) scale_quarter(span - 1, 1);
      _tile_loadd(5, q1 + f, Kp);
      PAGED_LLM_AMX_PRODUCT(2, 5, 6);
      if (scale_previous) scale_quarter(span - 1, 2);
      PAGED_LLM_AMX_PRODUCT(3, 5, 7);
      if (scale_previous) scale_quarter(span - 1, 3);
    }
    // GCC's tile stores declare that they write memory, so the scaling's reads stay on
    // their side of them (its tile loads do not: see amx_unpacked).
    _tile_stored(0, sums[span % 2][0], kSumRowBytes);
    _tile_stored(1, sums[span % 2][1], kSumRowBytes);
    _tile_stored(2, sums[span % 2][2], kSumRowBytes);
    _tile_stored(3, sums[span % 2][3], kSumRowBytes);
  }
  for (int quarter = 0; quarter < 4; ++quarter) scale_quarter(spans - 1, quarter);
  if (offset != nullptr) {
    for (int j = 0; j < 2; ++j) {
      const __m512 o = _mm512_loadu_ps(offset + j * group_stride);
      for (int64_t row = 0; row < kRows; ++row) {
        float* acc = result + row * kOutputs + j * kRowsPerBlock;
        _mm512_storeu_ps(acc, _mm512_fmadd_ps(o, _mm512_set1_ps(a.group_sums[m0 + row]), _mm512_loadu_ps(acc)));
      }
    }
  }
}
#undef PAGED_LLM_AMX_PRODUCT
#undef PAGED_LLM_AMX_SPAN
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
    for (int64_t k = k0; k < span_end(p, k0); k += kNibbles ? 8 : 4) {
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
      const __m256 dt = _mm256_set1_ps(d[t][k0 / p.act_block]);
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

// A pass over kBlocks row blocks by up to kMaxTile activation rows, dispatched to its
// fixed-size tiles.
template <template <bool, int, int> class Pass, bool kNibbles, int kBlocks, int kMaxTile>
void tiles(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
    const float* scale, const float* offset, int64_t m0, int64_t tile, float* result) {
  if constexpr (kMaxTile == 0) {
    return;
  } else {
    if (tile == kMaxTile) return Pass<kNibbles, kMaxTile, kBlocks>::run(p, a, codes, scale, offset, m0, result);
    return tiles<Pass, kNibbles, kBlocks, kMaxTile - 1>(p, a, codes, scale, offset, m0, tile, result);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
template <bool kNibbles, int kTile, int kBlocks>
struct Avx512Pass {
  static void run(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
      const float* scale, const float* offset, int64_t m0, float* result) {
    avx512_tile<kNibbles, kTile, kBlocks>(p, a, codes, scale, offset, m0, result);
  }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <bool kNibbles, int kTile, int kBlocks>
struct Avx2Pass {
  static_assert(kBlocks == 1, "the AVX2 pass takes one row block at a time");
  static void run(const Problem& p, const QuantizedActivations& a, const uint8_t* codes,
      const float* scale, const float* offset, int64_t m0, float* result) {
    avx2_tile<kNibbles, kTile>(p, a, codes, scale, offset, m0, result);
  }
};
#endif

// A tile function over `blocks` consecutive row blocks and the most activation rows it
// takes at once (what its registers hold: an integer and a float accumulator per row and
// block).
struct TileKernel {
  Tile run;
  int64_t max_rows;
  int64_t blocks;
};

// The pass's kernels: over two row blocks where it has one, and over one (the last odd
// block of a thread's range, or every block); what each thread does before its first tile
// and after its last (AMX's tile configuration), where anything.
struct PassKernels {
  TileKernel wide;
  TileKernel narrow;
  void (*begin_task)(const Problem&) = nullptr;
  void (*end_task)() = nullptr;
};

// Activation rows the AMX pass's tiles take at a time: two tiles of 16 (amx_tile_pair)
// from 17 rows where a span takes 64 features or more; else one (amx_tile: up to 16 rows
// two would multiply as many zero rows, and spans of 32 or 16 features, scaled every
// product, keep their 16 x 16 sums in registers, where the pair's 32 x 32 go through
// memory: there amx_tile_pair took 1.15-1.9x amx_tile's time on SmolLM2's projections,
// int8 or Q4_1, 16-256 rows).
int64_t amx_tile_rows(const Problem& p) { return p.rows > kAmxRows && p.span >= kAmxStep ? 2 * kAmxRows : kAmxRows; }

PassKernels pass(const Problem& p) {
#if defined(PAGED_LLM_AMX)
  if (uses_amx(p)) {
    const TileKernel one{p.nibbles ? amx_tile<true> : amx_tile<false>, kAmxRows, 1};
    if (amx_tile_rows(p) == kAmxRows) return {one, one, amx_configure, amx_release};
    return {{p.nibbles ? amx_tile_pair<true> : amx_tile_pair<false>, 2 * kAmxRows, 2}, one, amx_configure,
        amx_release};
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (p.isa == kAvx512Vnni || p.isa == kAmx) {
    return {{p.nibbles ? tiles<Avx512Pass, true, 2, 6> : tiles<Avx512Pass, false, 2, 6>, 6, 2},
        {p.nibbles ? tiles<Avx512Pass, true, 1, 8> : tiles<Avx512Pass, false, 1, 8>, 8, 1}};
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (p.isa == kAvx2) {
    const TileKernel one{p.nibbles ? tiles<Avx2Pass, true, 1, 2> : tiles<Avx2Pass, false, 1, 2>, 2, 1};
    return {one, one};
  }
#endif
  return {{generic_tile, 4, 1}, {generic_tile, 4, 1}};
}

// n float16 values as float32.
void widen(const at::Half* from, int64_t n, float* to) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(to + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i))));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  }
#endif
  for (; i < n; ++i) to[i] = static_cast<float>(from[i]);
}

// A weight's scales or offsets (float32 or float16) as float32, row block by row block.
class GroupValues {
 public:
  GroupValues(const at::Tensor& values, int64_t group_stride)
      : group_stride_(group_stride),
        float_data_(values.scalar_type() == at::kFloat ? values.const_data_ptr<float>() : nullptr),
        half_data_(values.scalar_type() == at::kHalf ? values.const_data_ptr<at::Half>() : nullptr) {}

  // Row blocks b .. b + blocks: in place where float32, else widened into `buffer`
  // (blocks * group_stride floats).
  const float* blocks(int64_t b, int64_t blocks, float* buffer) const {
    if (float_data_ != nullptr) return float_data_ + b * group_stride_;
    widen(half_data_ + b * group_stride_, blocks * group_stride_, buffer);
    return buffer;
  }

  bool widens() const { return half_data_ != nullptr; }

 private:
  int64_t group_stride_;
  const float* float_data_;
  const at::Half* half_data_;
};

template <typename T>
void matmul_impl(const Problem& p, const at::Tensor& x, const at::Tensor& codes,
    const at::Tensor& scale, const c10::optional<at::Tensor>& offset, at::Tensor& out) {
  const QuantizedActivations a = quantize_activations<T>(p, x.const_data_ptr<T>(), x.stride(0));
  const PassKernels kernels = pass(p);
  const uint8_t* code_data = codes.const_data_ptr<uint8_t>();
  const int64_t group_stride = p.num_groups * kRowsPerBlock;
  const GroupValues scales(scale, group_stride);
  const c10::optional<GroupValues> offsets =
      offset.has_value() ? c10::make_optional(GroupValues(*offset, group_stride)) : c10::nullopt;
  const int64_t max_blocks = std::max(kernels.wide.blocks, kernels.narrow.blocks);
  T* out_data = out.data_ptr<T>();
  const int64_t out_stride = out.stride(0);
  const int64_t macs = std::max<int64_t>(1, p.rows * p.padded_features * kRowsPerBlock);
  const int64_t result_size = kRowsPerBlock *
      std::max(kernels.wide.max_rows * kernels.wide.blocks, kernels.narrow.max_rows * kernels.narrow.blocks);
  at::parallel_for(0, p.row_blocks, std::max<int64_t>(1, kMacsPerTask / macs), [&](int64_t b0, int64_t b1) {
    std::vector<float> result(result_size);
    std::vector<float> widened(scales.widens() ? 2 * max_blocks * group_stride : 0);
    if (kernels.begin_task != nullptr) kernels.begin_task(p);
    // Activation rows a chunk at a time, each by all of the task's row blocks: the chunk's
    // activation codes stay in cache while the weight's stream past, and its outputs are
    // written a row's share at a time, where block by block over all rows each output line
    // was a scattered write (SmolLM2's down projection, 2,048 rows, one thread: 56 ns an AMX
    // tile product block by block, 42 by chunks). 4-bit codes on AMX take all rows as one
    // chunk: that pass unpacks a row block's codes once per chunk.
    const int64_t chunk = uses_amx(p) && p.nibbles ? p.rows : kRowChunk;
    for (int64_t c0 = 0; c0 < p.rows; c0 += chunk) {
      const int64_t c1 = std::min(p.rows, c0 + chunk);
      for (int64_t b = b0; b < b1;) {
        const TileKernel& kernel = b + kernels.wide.blocks <= b1 ? kernels.wide : kernels.narrow;
        const int64_t n0 = b * kRowsPerBlock;
        const int64_t valid = std::min(kernel.blocks * kRowsPerBlock, p.out_features - n0);
        const float* block_scale = scales.blocks(b, kernel.blocks, widened.data());
        const float* block_offset = offsets.has_value()
            ? offsets->blocks(b, kernel.blocks, widened.data() + max_blocks * group_stride)
            : nullptr;
        for (int64_t m0 = c0; m0 < c1; m0 += kernel.max_rows) {
          const int64_t tile = std::min(kernel.max_rows, c1 - m0);
          kernel.run(p, a, code_data + b * p.block_stride, block_scale, block_offset, m0, tile, result.data());
          for (int64_t t = 0; t < tile; ++t) {
            T* row = out_data + (m0 + t) * out_stride + n0;
            const float* values = result.data() + t * kernel.blocks * kRowsPerBlock;
            for (int64_t l = 0; l < valid; ++l) paged_llm_cpu::store(row + l, values[l]);
          }
        }
        b += kernel.blocks;
      }
    }
    if (kernels.end_task != nullptr) kernels.end_task();
  });
}

// A product rounded to float32 before the sum that follows: torch's dequantize multiplies
// and adds in two operations, which the compiler would fuse into one FMA, rounding once
// (7 * 0.00110688 - 0.00774817 then gives -1.2e-10, not torch's 0). A volatile store hides
// the product's origin from it; the scalar loop that needs it takes only what the vector
// one leaves (a row's last features, a last partial row block) or builds without AVX-512.
inline float unfused(float product) {
  volatile float rounded = product;
  return rounded;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 float32 values rounded to bfloat16 as `paged_llm_cpu::store` rounds them (to nearest
// even; vcvtneps2bf16 would flush float32 denormals to zero). Weight values are finite.
inline __m256i to_bfloat16(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// The same for a vector: the empty asm makes the product opaque to the compiler at no cost.
inline __m512 unfused(__m512 product) {
  asm("" : "+v"(product));
  return product;
}

// Row `row` of a row block at features k .. k + 15 from its 16 codes: times its group's
// scale, plus its offset, rounded to bfloat16 and stored (32 bytes) at `out`.
inline void dequantize_row(__m128i codes, bool is_signed, float scale, const float* offset, c10::BFloat16* out) {
  const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(codes) : _mm512_cvtepu8_epi32(codes);
  __m512 values = unfused(_mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale)));
  if (offset != nullptr) values = _mm512_add_ps(values, _mm512_set1_ps(*offset));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bfloat16(values));
}

// Rows 4L + i of a row block from `rows_i` (lane L of vector i holds row 4L + i's 16 codes).
template <int L>
inline void dequantize_rows_of_lane(const __m512i (&rows_i)[4], bool is_signed, const float* scale,
    const float* offset, c10::BFloat16* rows, int64_t K, int64_t k) {
  for (int i = 0; i < 4; ++i) {
    const int64_t row = 4 * L + i;
    dequantize_row(_mm512_extracti32x4_epi32(rows_i[i], L), is_signed, scale[row],
        offset != nullptr ? offset + row : nullptr, rows + row * K + k);
  }
}

// A whole row block's (16 rows') features below the last multiple of 16 under K; returns
// the feature where it stopped. `scale` and `offset` (or null): [groups][16]. Sixteen
// features lie in one group (groups are 16 features, a multiple of 32, or whole rows).
int64_t dequantize_block(const uint8_t* codes, const float* scale, const float* offset, bool nibbles,
    int64_t group_size, int64_t num_groups, int64_t K, c10::BFloat16* rows) {
  const int64_t whole = K / 16 * 16;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t k = 0; k < whole; k += 16) {
    // Four vectors of features k + 4j .. k + 4j + 3 (j = 0..3), row r's four codes in 32-bit
    // lane r: 8-bit codes are packed so; a 4-bit vector holds two of them, low nibbles first.
    __m512i v[4];
    if (nibbles) {
      for (int h = 0; h < 2; ++h) {
        const __m512i packed = _mm512_loadu_si512(codes + (k / 8 + h) * kBlockBytes);
        v[2 * h] = _mm512_and_si512(packed, low_nibbles);
        v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      }
    } else {
      for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(codes + (k / 4 + j) * kBlockBytes);
    }
    // A 4 x 4 transpose of 32-bit lanes within each 128-bit lane: lane L of rows_i[i] then
    // holds row 4L + i's codes for features k .. k + 15, in order.
    const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    const __m512i rows_i[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    const int64_t g = std::min(k / group_size, num_groups - 1);
    const float* group_scale = scale + g * kRowsPerBlock;
    const float* group_offset = offset != nullptr ? offset + g * kRowsPerBlock : nullptr;
    dequantize_rows_of_lane<0>(rows_i, !nibbles, group_scale, group_offset, rows, K, k);
    dequantize_rows_of_lane<1>(rows_i, !nibbles, group_scale, group_offset, rows, K, k);
    dequantize_rows_of_lane<2>(rows_i, !nibbles, group_scale, group_offset, rows, K, k);
    dequantize_rows_of_lane<3>(rows_i, !nibbles, group_scale, group_offset, rows, K, k);
  }
  return whole;
}
#endif

// out [R, K] bfloat16 = rows row0 .. row0 + R (row0 a multiple of 16) of the weight packed
// as above, W[n, k] = scale * code + offset with the product and the sum each rounded to
// float32 and the result once to bfloat16: GroupQuantizedWeight.dequantize's values, bit
// for bit. What a bfloat16 matmul of many rows multiplies by with oneDNN's GEMM
// (paged_llm's `cpu_matmul.matmul`), rather than quantizing its activations.
void packed_dequantize(const at::Tensor& codes, const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
    int64_t group_size, bool nibbles, int64_t row0, at::Tensor& out) {
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes must be contiguous uint8");
  TORCH_CHECK(scale.is_contiguous() && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
      "scale must be contiguous float32 or float16");
  TORCH_CHECK(!offset.has_value() || (offset->is_contiguous() && offset->scalar_type() == scale.scalar_type()),
      "offset must be contiguous, of scale's dtype");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
      "out must be contiguous bfloat16 [R, K]");
  const int64_t R = out.size(0), K = out.size(1);
  const int64_t padded_features = codes.size(1) / (nibbles ? 8 : 16);
  TORCH_CHECK(K <= padded_features, "out has more features than the codes");
  TORCH_CHECK(row0 % kRowsPerBlock == 0 && row0 + R <= codes.size(0) * kRowsPerBlock, "rows out of range");
  const int64_t num_groups = scale.size(1);
  const int64_t group = std::min(group_size, padded_features);
  const int64_t group_stride = num_groups * kRowsPerBlock;
  const GroupValues scales(scale, group_stride);
  const c10::optional<GroupValues> offsets =
      offset.has_value() ? c10::make_optional(GroupValues(*offset, group_stride)) : c10::nullopt;
  const uint8_t* code_data = codes.const_data_ptr<uint8_t>();
  c10::BFloat16* out_data = out.data_ptr<c10::BFloat16>();
  const int64_t first = row0 / kRowsPerBlock, last = (row0 + R + kRowsPerBlock - 1) / kRowsPerBlock;
  at::parallel_for(first, last, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> widened(scales.widens() ? 2 * group_stride : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* block = code_data + b * codes.size(1);
      const float* s = scales.blocks(b, 1, widened.data());
      const float* o = offsets.has_value() ? offsets->blocks(b, 1, widened.data() + group_stride) : nullptr;
      const int64_t n0 = b * kRowsPerBlock - row0;
      const int64_t lanes = std::min(kRowsPerBlock, R - n0);
      c10::BFloat16* rows = out_data + n0 * K;
      int64_t done = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (lanes == kRowsPerBlock) done = dequantize_block(block, s, o, nibbles, group, num_groups, K, rows);
#endif
      for (int64_t l = 0; l < lanes; ++l) {
        for (int64_t k = done; k < K; ++k) {
          const int64_t g = std::min(k / group, num_groups - 1);
          float value = unfused(s[g * kRowsPerBlock + l] * static_cast<float>(packed_code(block, nibbles, l, k)));
          if (o != nullptr) value = value + o[g * kRowsPerBlock + l];
          paged_llm_cpu::store(rows + l * K + k, value);
        }
      }
    }
  });
}

// out [M, N] (x's dtype) = x [M, K] (float32 or bfloat16, rows contiguous) times the
// transposed weight packed as above (codes [N16 / 16, bytes] uint8, scale and offset
// [N16 / 16, groups, 16] float32, or both float16), activations quantized per act_block
// features. `isa`:
// 0 generic, 1 AVX2, 2 AVX-512 VNNI, 3 AMX (with the VNNI pass below kAmxMinRows rows,
// kAmxMinRowsNibbles for 4-bit codes).
void packed_quantized_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
    const c10::optional<at::Tensor>& offset, int64_t out_features, int64_t group_size, int64_t act_block,
    bool nibbles, int64_t isa, at::Tensor& out) {
  TORCH_CHECK(isa >= kGeneric && isa <= kAmx, "isa must be 0, 1, 2 or 3");
  TORCH_CHECK(runnable(static_cast<Isa>(isa)), "this build or process has no pass ", isa);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes must be contiguous uint8");
  TORCH_CHECK(scale.is_contiguous() && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
      "scale must be contiguous float32 or float16");
  TORCH_CHECK(!offset.has_value() || (offset->is_contiguous() && offset->scalar_type() == scale.scalar_type()),
      "offset must be contiguous, of scale's dtype");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.stride(1) == 1, "out must be x's dtype");
  Problem p{};
  p.rows = x.size(0);
  p.in_features = x.size(1);
  p.out_features = out_features;
  const bool one_group_a_row = group_size >= p.in_features;
  TORCH_CHECK(one_group_a_row || group_size == 16 || group_size % kActBlock == 0,
      "groups must be 16 features, a multiple of 32, or whole rows");
  TORCH_CHECK(act_block == kActBlock || (one_group_a_row && act_block > 0 && act_block % kAmxStep == 0),
      "act_block must be 32, or a multiple of 64 for a weight of one group a row");
  const int64_t feature_multiple = act_block == kActBlock ? kActBlock : kAmxStep;
  p.padded_features = (p.in_features + feature_multiple - 1) / feature_multiple * feature_multiple;
  p.group_size = std::min(group_size, p.padded_features);
  p.num_groups = scale.size(1);
  p.act_block = act_block;
  p.act_blocks = (p.padded_features + act_block - 1) / act_block;
  p.span = !one_group_a_row && group_size == 16 ? 16 : act_block;
  p.spans = (p.padded_features + p.span - 1) / p.span;
  p.nibbles = nibbles;
  p.has_offset = offset.has_value();
  p.isa = static_cast<Isa>(isa);
  // The AMX pass reads whole tiles of activation rows.
  const int64_t row_multiple = uses_amx(p) ? amx_tile_rows(p) : 1;
  p.padded_rows = (p.rows + row_multiple - 1) / row_multiple * row_multiple;
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
  for (Isa isa : {kAmx, kAvx512Vnni, kAvx2, kGeneric}) {
    if (runnable(isa)) isas.push_back(isa);
  }
  return isas;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_llm_cpu, m) {
  m.def(
      "packed_quantized_matmul(Tensor x, Tensor codes, Tensor scale, Tensor? offset, "
      "int out_features, int group_size, int act_block, bool nibbles, int isa, Tensor(a!) out) -> ()");
  m.def("quantized_matmul_isas() -> int[]");
  m.def(
      "packed_dequantize(Tensor codes, Tensor scale, Tensor? offset, int group_size, bool nibbles, int row0, "
      "Tensor(a!) out) -> ()");
  m.impl("packed_quantized_matmul", c10::DispatchKey::CPU, &packed_quantized_matmul);
  m.impl("quantized_matmul_isas", c10::DispatchKey::CatchAll, &quantized_matmul_isas);
  m.impl("packed_dequantize", c10::DispatchKey::CPU, &packed_dequantize);
}
