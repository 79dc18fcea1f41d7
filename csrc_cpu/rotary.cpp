// Rotary position embedding on CPU, in place on the query and key heads (NeoX / Hugging
// Face "rotate_half" layout): one pass over each head instead of torch's chain of eight
// operators and their temporaries a call.
//
// Each product and the sum are rounded to T where transformers' expression
// (q * cos + rotate_half(q) * sin, in the activations' dtype) rounds them, so results are
// bit-identical to it in every dtype. That needs the products kept apart from the sums:
// this file is compiled without floating-point contraction (a fused multiply-add rounds
// once where torch rounds twice).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "convert.h"

#pragma GCC optimize("fp-contract=off")

namespace {

using paged_llm_cpu::load;
using paged_llm_cpu::round_to;
using paged_llm_cpu::store;

// As rms_norm.cpp: torch's grain, so a decode step's few tokens run on the calling thread.
constexpr int64_t kElementsPerTask = 32768;

// [x1, x2] <- [x1 cos - x2 sin, x2 cos + x1 sin] for one head of 2 * half elements.
template <typename T>
void rotate_head(T* head, const T* cos, const T* sin, int64_t half) {
  T* first = head;
  T* second = head + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(first + i);
    const float x2 = load(second + i);
    const float c = load(cos + i);
    const float s = load(sin + i);
    store(first + i, round_to<T>(x1 * c) - round_to<T>(x2 * s));
    store(second + i, round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

template <typename T>
void rotate_impl(at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
    const at::Tensor& sin) {
  const int64_t tokens = query.size(0);
  const int64_t query_heads = query.size(1);
  const int64_t key_heads = key.size(1);
  const int64_t half = query.size(2) / 2;
  T* query_data = query.data_ptr<T>();
  T* key_data = key.data_ptr<T>();
  const T* cos_data = cos.const_data_ptr<T>();
  const T* sin_data = sin.const_data_ptr<T>();
  const int64_t per_token = (query_heads + key_heads) * 2 * half;
  const int64_t tokens_per_task = std::max<int64_t>(1, kElementsPerTask / per_token);
  at::parallel_for(0, tokens, tokens_per_task, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos_row = cos_data + t * cos.stride(0);
      const T* sin_row = sin_data + t * sin.stride(0);
      for (int64_t h = 0; h < query_heads; ++h) {
        rotate_head(query_data + t * query.stride(0) + h * query.stride(1), cos_row, sin_row, half);
      }
      for (int64_t h = 0; h < key_heads; ++h) {
        rotate_head(key_data + t * key.stride(0) + h * key.stride(1), cos_row, sin_row, half);
      }
    }
  });
}

// The Python wrapper (csrc_cpu/__init__.py) picks the shapes; these checks only guard the
// memory this code reads and writes.
void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& cos,
    const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0)
      && query.size(2) == key.size(2) && query.size(2) % 2 == 0 && query.stride(2) == 1
      && key.stride(2) == 1, "rotary_embedding: query [T, H, D] and key [T, Hkv, D], D even, "
      "with contiguous heads");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == query.size(0)
      && cos.size(1) == query.size(2) / 2 && sin.sizes() == cos.sizes() && cos.stride(1) == 1
      && sin.stride(1) == 1, "rotary_embedding: cos and sin must be [T, D / 2], rows contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && cos.scalar_type() == query.scalar_type()
      && sin.scalar_type() == query.scalar_type(), "rotary_embedding: one dtype for all four");
  switch (query.scalar_type()) {
    case at::kFloat:
      return rotate_impl<float>(query, key, cos, sin);
    case at::kBFloat16:
      return rotate_impl<c10::BFloat16>(query, key, cos, sin);
    case at::kHalf:
      return rotate_impl<c10::Half>(query, key, cos, sin);
    default:
      TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_llm_cpu, m) {
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
}
