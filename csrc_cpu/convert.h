// Loads and stores of float32 values in an element type, written so that loops of them
// vectorize: through c10::BFloat16's struct copies and conversions a loop stayed scalar,
// and a bfloat16 RMSNorm took 6x a float32 one of the same rows. They read and write the
// element's 16 bits as a uint16_t, never through memcpy, which may alias anything (the
// compiler then reloads a loop's bounds after every store). The bits are c10's.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace paged_llm_cpu {

template <typename T>
inline float load(const T* element) {
  return static_cast<float>(*element);
}

template <>
inline float load(const c10::BFloat16* element) {
  const uint32_t bits = static_cast<uint32_t>(element->x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename T>
inline void store(T* element, float value) {
  *element = static_cast<T>(value);
}

// Round to nearest even, NaN to the quiet NaN 0x7FC0, as c10 does, with a select in
// place of its branch.
template <>
inline void store(c10::BFloat16* element, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  element->x = static_cast<uint16_t>(is_nan ? 0x7FC0u : rounded);
}

// `value` rounded to T, as a float: where a torch chain stores an intermediate in T.
template <typename T>
inline float round_to(float value) {
  T element;
  store(&element, value);
  return load(&element);
}

}  // namespace paged_llm_cpu
