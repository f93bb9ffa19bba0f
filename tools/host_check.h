// SPDX-License-Identifier: Apache-2.0
// CHECK for the host-side index-math checks (tools/*_check.cu): counts failures in g_fail and
// prints the first 20 with file, line, condition and a printf-style message.
#pragma once
#include <cstdio>

static int g_fail = 0;
#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            if (g_fail++ < 20) {                                            \
                std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
                std::printf(__VA_ARGS__);                                   \
                std::printf("\n");                                          \
            }                                                               \
        }                                                                   \
    } while (0)
