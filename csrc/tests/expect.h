// The C++ tests' check: EXPECT(cond) prints the failed condition and counts it; main returns failures != 0.
#pragma once

#include <cstdio>

static int failures = 0;
#define EXPECT(cond)                                                \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);   \
      ++failures;                                                   \
    }                                                               \
  } while (0)
