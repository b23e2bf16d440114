// Element-wise reductions of device data, compiled at run time (CuPy RawModule; NVRTC or hiprtc).
// float16 and bfloat16 are handled as raw 16-bit patterns converted by hand, so the same source
// compiles under CUDA and HIP without either vendor's half-precision headers; they accumulate
// in float32 and round to nearest even once.

typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    u32 bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
            bits = sign | ((u32)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return __int_as_float((int)bits);
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = (u32)__float_as_int(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // inf or nan
        return (u16)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    }
    if (ax >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
        return (u16)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        if (ax < 0x33000000u) return (u16)sign;  // below half the smallest subnormal
        u32 e = ax >> 23;
        u32 m = (ax & 0x7fffffu) | 0x800000u;
        u32 shift = 126 - e;  // value = m * 2^(e-150); in units of 2^-24 that is m >> (126 - e)
        u32 val = m >> shift;
        u32 rem = m & ((1u << shift) - 1u);
        u32 half = 1u << (shift - 1);
        if (rem > half || (rem == half && (val & 1u))) ++val;
        return (u16)(sign | val);
    }
    u32 r = ax + 0xc8000fffu + ((ax >> 13) & 1u);  // rebias exponent (-112 << 23) and round
    return (u16)(sign | (r >> 13));
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __int_as_float((int)((u32)h << 16)); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = (u32)__float_as_int(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);  // quiet nan
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

struct Sum { template <typename T> __device__ static T f(T a, T b) { return a + b; } };
struct Prod { template <typename T> __device__ static T f(T a, T b) { return a * b; } };
struct Min {
    template <typename T> __device__ static T f(T a, T b) { return b < a ? b : a; }
    __device__ static float f(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
    __device__ static double f(double a, double b) { return (a != a || b != b) ? a + b : fmin(a, b); }
};
struct Max {
    template <typename T> __device__ static T f(T a, T b) { return b > a ? b : a; }
    __device__ static float f(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
    __device__ static double f(double a, double b) { return (a != a || b != b) ? a + b : fmax(a, b); }
};
struct Or { template <typename T> __device__ static T f(T a, T b) { return (T)(a || b); } };
struct And { template <typename T> __device__ static T f(T a, T b) { return (T)(a && b); } };

// Plain dtypes: dst[i] = op(dst[i], src[i])
template <typename T, typename Op>
__global__ void combine(T* dst, const T* src, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        dst[i] = Op::f(dst[i], src[i]);
    }
}

// Halves: Half = 0 for float16, 1 for bfloat16
template <int Half, typename Op>
__global__ void combine_half(u16* dst, const u16* src, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        float a = Half ? bf16_to_f32(dst[i]) : f16_to_f32(dst[i]);
        float b = Half ? bf16_to_f32(src[i]) : f16_to_f32(src[i]);
        float c = Op::f(a, b);
        dst[i] = Half ? f32_to_bf16(c) : f32_to_f16(c);
    }
}

// Averages: floats divide, integers truncate toward zero (C division)
template <typename T>
__global__ void divide(T* dst, unsigned long long n, long long d) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        dst[i] = (T)(dst[i] / (T)d);
    }
}

template <int Half>
__global__ void divide_half(u16* dst, unsigned long long n, long long d) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        float a = Half ? bf16_to_f32(dst[i]) : f16_to_f32(dst[i]);
        float c = a / (float)d;
        dst[i] = Half ? f32_to_bf16(c) : f32_to_f16(c);
    }
}

// Peer reductions (device-direct transport): acc = op over `nsrc` (1..8) sources, in source
// order, each a pointer that may point into another process's memory (CUDA/HIP IPC mapping);
// then acc is written to `nout` (1..8) outputs. Every rank reduces in the same order, so every
// rank gets the same bits. One rank serving ranks that share its GPU writes every output in the
// same pass (each element read once from each source, written once to each output; in place is
// safe, since a thread reads all sources of element i before it writes element i). `div` > 0
// divides the reduction (AVG): floats divide, integers truncate toward zero like C. The loops
// over sources and outputs are unrolled so the pointers stay in registers. The launch's
// pointers and sizes travel as one parameter by value (`Peers`, the host's PEERS_DTYPE): passed
// one by one, the twenty of them cost the host more than the launch itself.
struct Peers {
    unsigned long long d[8];  // outputs (nout of them)
    unsigned long long s[8];  // sources (nsrc of them)
    unsigned long long n;     // elements
    long long div;
    int nout;
    int nsrc;
};
#define PEER_POINTERS(T) \
    const T* s[8]; \
    T* d[8]; \
    _Pragma("unroll") for (int k = 0; k < 8; ++k) { \
        s[k] = (const T*)a.s[k]; \
        d[k] = (T*)a.d[k]; \
    } \
    const int nout = a.nout, nsrc = a.nsrc; \
    const unsigned long long n = a.n; \
    const long long div = a.div
#define FOR_EACH_ELEMENT \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; \
         i += (unsigned long long)blockDim.x * gridDim.x)
#define STORE_ALL(value) \
    _Pragma("unroll") for (int k = 0; k < 8; ++k) { if (k < nout) d[k][i] = (value); }

// Element i reduced over sources s[0..nsrc), in order, divided by `div` where > 0: the one
// loop of reduce_peers and reduce_pieces (s: pointers in registers, the loop unrolled).
template <typename T, typename Op>
__device__ __forceinline__ T reduce_at(const T* const* s, int nsrc, unsigned long long i,
                                       long long div) {
    T acc = s[0][i];
#pragma unroll
    for (int k = 1; k < 8; ++k) {
        if (k < nsrc) acc = Op::f(acc, s[k][i]);
    }
    if (div > 0) acc = (T)(acc / (T)div);
    return acc;
}

// Halves accumulate in float32 over every source and round once.
template <int Half, typename Op>
__device__ __forceinline__ u16 reduce_half_at(const u16* const* s, int nsrc,
                                              unsigned long long i, long long div) {
    float acc = Half ? bf16_to_f32(s[0][i]) : f16_to_f32(s[0][i]);
#pragma unroll
    for (int k = 1; k < 8; ++k) {
        if (k < nsrc) acc = Op::f(acc, Half ? bf16_to_f32(s[k][i]) : f16_to_f32(s[k][i]));
    }
    if (div > 0) acc = acc / (float)div;
    return Half ? f32_to_bf16(acc) : f32_to_f16(acc);
}

template <typename T, typename Op>
__global__ void reduce_peers(Peers a) {
    PEER_POINTERS(T);
    FOR_EACH_ELEMENT {
        T acc = reduce_at<T, Op>(s, nsrc, i, div);
        STORE_ALL(acc)
    }
}

template <int Half, typename Op>
__global__ void reduce_peers_half(Peers a) {
    PEER_POINTERS(u16);
    FOR_EACH_ELEMENT {
        u16 out = reduce_half_at<Half, Op>(s, nsrc, i, div);
        STORE_ALL(out)
    }
}

// float32 sums, the common case of gradients, 16 bytes per load (n = elements / 4; pointers
// 16-byte aligned; the caller reduces the tail with reduce_peers).
__global__ void reduce_peers_f32x4(Peers a) {
    PEER_POINTERS(float4);
    FOR_EACH_ELEMENT {
        float4 acc = s[0][i];
#pragma unroll
        for (int k = 1; k < 8; ++k) {
            if (k < nsrc) {
                float4 v = s[k][i];
                acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            }
        }
        if (div > 0) {
            float q = (float)div;
            acc.x /= q; acc.y /= q; acc.z /= q; acc.w /= q;
        }
        STORE_ALL(acc)
    }
}

// Many small pieces in one launch (all_reduce_coalesced where the ranks share one GPU): piece
// blockIdx.y is `n[y]` elements at `p[y][0..nranks)`, one address per rank, each both a source
// (in rank order) and an output, as reduce_peers with the same pointers as sources and outputs.
// The table travels by value in the launch's parameters, so one launch needs no copy of it.
// Pieces never overlap (the caller refuses overlapping arrays), so blocks of different pieces
// never touch the same memory.
#define PIECES 32
struct Pieces {
    unsigned long long n[PIECES];
    unsigned long long p[PIECES][8];
};
#define PIECE_POINTERS(T) \
    const unsigned long long n = t.n[blockIdx.y]; \
    T* d[8]; \
    _Pragma("unroll") for (int k = 0; k < 8; ++k) d[k] = (T*)t.p[blockIdx.y][k]
#define STORE_RANKS(value) \
    _Pragma("unroll") for (int k = 0; k < 8; ++k) { if (k < nranks) d[k][i] = (value); }

template <typename T, typename Op>
__global__ void reduce_pieces(Pieces t, int nranks, long long div) {
    PIECE_POINTERS(T);
    FOR_EACH_ELEMENT {
        T acc = reduce_at<T, Op>(d, nranks, i, div);
        STORE_RANKS(acc)
    }
}

template <int Half, typename Op>
__global__ void reduce_pieces_half(Pieces t, int nranks, long long div) {
    PIECE_POINTERS(u16);
    FOR_EACH_ELEMENT {
        u16 out = reduce_half_at<Half, Op>(d, nranks, i, div);
        STORE_RANKS(out)
    }
}

// Copies by the SMs, 16 bytes per load. The direct transport copies peer memory with
// cudaMemcpyAsync, which measured faster through an IPC mapping on the H200 (1976-2009 GB/s
// against 1820-1888 GB/s for this kernel); it uses this one where PEER_COPY = "kernel".
__global__ void copy16(uint4* dst, const uint4* src, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        dst[i] = src[i];
    }
}
