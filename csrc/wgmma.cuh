// SPDX-License-Identifier: Apache-2.0
// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) for the fused-dequant MMA kernel (mma.cu, taken
// by shape, see use_wgmma; KBIT_MMA_WGMMA=0/1 overrides; design: docs/wgmma-plan.md).
//  * A = the dequantized weights, from registers: for m64nNk16 each warp of the warpgroup supplies
//    the mma.m16n8k16 A fragment of its own 16 rows, which is what frag::tile_step already builds.
//  * B = the x tile in shared memory, K-major without swizzle: 8x8 core matrices of 128 contiguous
//    bytes (8 tokens x 16 B), the two 8-column halves of a k16 step kWgLbo apart, 8-token groups
//    kWgSbo apart. The tensor cores read it directly: one wgmma replaces TM/8 mma.sync and their
//    ldmatrix loads of x, and the accumulator layout is the mma.sync one (store_acc_tile works).
// Device code only for sm_90a (KBIT_WGMMA_DEVICE); other targets compile a trap, and the host only
// selects the path when the build has sm_90a code (KBIT_SM90A, set by setup.py for a 9.0a arch).
#pragma once
#include <cstdint>

namespace kbit {
namespace frag {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA_DEVICE 1
#endif

constexpr int kWgLbo = 128;   // leading-dimension byte offset: next 8 columns (K)
constexpr int kWgSbo = 2048;  // stride-dimension byte offset: next 8 tokens (16 chunks x 128 B)

// Byte offset of token `tok`, 16-byte column chunk `chunk` (columns 8 chunk .. +7) in a k-tile.
__host__ __device__ constexpr int wg_x_offset(int tok, int chunk) {
    return (tok >> 3) * kWgSbo + chunk * kWgLbo + (tok & 7) * 16;
}

// Shared-memory matrix descriptor: start address >> 4 (bits 0-13), LBO >> 4 (16-29), SBO >> 4
// (32-45), base offset 0, layout 0 = no swizzle (62-63).
__device__ __forceinline__ uint64_t wg_desc(uint32_t smem_addr) {
    return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) |
           (static_cast<uint64_t>(kWgLbo >> 4) << 16) | (static_cast<uint64_t>(kWgSbo >> 4) << 32);
}

__device__ __forceinline__ void wg_fence() {  // orders register writes before the next wgmma
#if defined(KBIT_WGMMA_DEVICE)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {  // closes the group of the wgmmas issued so far
#if defined(KBIT_WGMMA_DEVICE)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups are pending: their A registers and accumulators may then
// be touched again (PTX: reading or writing them earlier is undefined).
template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(KBIT_WGMMA_DEVICE)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// cp.async writes x through the generic proxy, wgmma reads it through the async proxy: each
// thread fences its landed copies before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(KBIT_WGMMA_DEVICE)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d[64 x 32] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N32K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15 " \
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x 56] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N56K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %33, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n56k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27 " \
        "}, {%28, %29, %30, %31}, %32, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x 64] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N64K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 " \
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x 112] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N112K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n112k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55 " \
        "}, {%56, %57, %58, %59}, %60, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x 128] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N128K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 " \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x 224] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N224K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %117, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n224k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111 " \
        "}, {%112, %113, %114, %115}, %116, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x 256] += A * B: T = "bf16" or "f16" (PTX type of A and B).
#define KBIT_WGMMA_M64N256K16(T) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 " \
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) \
        : "memory")

// d[64 x N] += A[64 x 16] (registers) * B[16 x N] (descriptor), fp32 accumulators in the
// mma.sync C order per 8 columns: the first N / 2 of d (a larger d serves narrower tiles with a
// prefix of it). Issued by all 128 threads of a warpgroup.
template <bool BF16, int N, int D>
__device__ __forceinline__ void wgmma_rs(float (&d)[D], const uint32_t (&a)[4], uint64_t desc) {
    static_assert(N == 32 || N == 56 || N == 64 || N == 112 || N == 128 || N == 224 || N == 256,
                  "wgmma_rs: N = 32, 56, 64, 112, 128, 224 or 256");
    static_assert(D >= N / 2, "wgmma_rs: too few accumulators");
#if defined(KBIT_WGMMA_DEVICE)
    if constexpr (N == 32) {
        if constexpr (BF16) KBIT_WGMMA_M64N32K16("bf16");
        else KBIT_WGMMA_M64N32K16("f16");
    } else if constexpr (N == 56) {
        if constexpr (BF16) KBIT_WGMMA_M64N56K16("bf16");
        else KBIT_WGMMA_M64N56K16("f16");
    } else if constexpr (N == 64) {
        if constexpr (BF16) KBIT_WGMMA_M64N64K16("bf16");
        else KBIT_WGMMA_M64N64K16("f16");
    } else if constexpr (N == 112) {
        if constexpr (BF16) KBIT_WGMMA_M64N112K16("bf16");
        else KBIT_WGMMA_M64N112K16("f16");
    } else if constexpr (N == 128) {
        if constexpr (BF16) KBIT_WGMMA_M64N128K16("bf16");
        else KBIT_WGMMA_M64N128K16("f16");
    } else if constexpr (N == 224) {
        if constexpr (BF16) KBIT_WGMMA_M64N224K16("bf16");
        else KBIT_WGMMA_M64N224K16("f16");
    } else {
        if constexpr (BF16) KBIT_WGMMA_M64N256K16("bf16");
        else KBIT_WGMMA_M64N256K16("f16");
    }
#else
    (void)d, (void)a, (void)desc;
    __trap();  // never launched: the host selects this path only for sm_90a builds on sm_90
#endif
}

}  // namespace frag
}  // namespace kbit

#undef KBIT_WGMMA_M64N32K16
#undef KBIT_WGMMA_M64N56K16
#undef KBIT_WGMMA_M64N112K16
#undef KBIT_WGMMA_M64N224K16
#undef KBIT_WGMMA_M64N64K16
#undef KBIT_WGMMA_M64N128K16
#undef KBIT_WGMMA_M64N256K16
