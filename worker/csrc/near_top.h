// The near-top window of greedy steps: the logits at or above `near_top_threshold(top, ...)`,
// two spacings of the model dtype's numbers below the row's maximum.
#pragma once

#include "vector_helpers.h"

namespace {

// Two spacings of the model dtype's numbers below `top`: only values at or above it count as near the top.
inline float near_top_threshold(float top, float model_eps, float model_tiny) {
  int exponent = 0;
  std::frexp(std::max(std::fabs(top), model_tiny), &exponent);  // |top| = m * 2^exponent, m in [0.5, 1)
  return top - 2.0f * std::ldexp(model_eps, exponent - 1);
}

}  // namespace
