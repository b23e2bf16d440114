// Tensor fusion: many device arrays packed into one contiguous buffer, and unpacked back, in one
// launch each (CuPy RawModule; NVRTC or hiprtc, no vendor headers).
//
// The table holds one row of FUSION_COLS 64-bit integers per array:
//   [0] address of the array's first element   [1] its offset in the fused buffer (elements)
//   [2] element count                          [3] ndim: 0 = contiguous, else 1..FUSION_DIMS
//   [4 .. 4+FUSION_DIMS)  shape               [4+FUSION_DIMS .. 4+2*FUSION_DIMS)  strides (elements)
// Block row y walks arrays y, y + gridDim.y, ...; the x blocks of a row stride over one array's
// elements, so one launch serves any mix of sizes. T only carries the element size (bytes are
// copied, never interpreted), so one instantiation per size serves every dtype.

#define FUSION_DIMS 6
#define FUSION_COLS (4 + 2 * FUSION_DIMS)

typedef long long i64;

// Offset (in elements) of the i-th element, in row-major order, of a strided array.
__device__ __forceinline__ i64 strided_offset(i64 i, int ndim, const i64* shape, const i64* stride) {
    i64 off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
        i64 n = shape[d];
        off += (i % n) * stride[d];
        i /= n;
    }
    return off;
}

template <typename T>
__global__ void fusion_pack(const i64* table, int arrays, T* fused) {
    for (int a = blockIdx.y; a < arrays; a += gridDim.y) {
        const i64* row = table + (i64)a * FUSION_COLS;
        const T* src = (const T*)row[0];
        T* dst = fused + row[1];
        i64 count = row[2];
        int ndim = (int)row[3];
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count;
             i += (i64)blockDim.x * gridDim.x) {
            i64 at = ndim ? strided_offset(i, ndim, row + 4, row + 4 + FUSION_DIMS) : i;
            dst[i] = src[at];
        }
    }
}

template <typename T>
__global__ void fusion_unpack(const i64* table, int arrays, const T* fused) {
    for (int a = blockIdx.y; a < arrays; a += gridDim.y) {
        const i64* row = table + (i64)a * FUSION_COLS;
        T* dst = (T*)row[0];
        const T* src = fused + row[1];
        i64 count = row[2];
        int ndim = (int)row[3];
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < count;
             i += (i64)blockDim.x * gridDim.x) {
            i64 at = ndim ? strided_offset(i, ndim, row + 4, row + 4 + FUSION_DIMS) : i;
            dst[at] = src[i];
        }
    }
}
