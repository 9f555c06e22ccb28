/* Block quantization for CPU tensors: the same codes and values as blocks.py's torch path,
 * in one pass per block instead of one pass per operation.
 *
 * Formats handled: uniform INT8, INT4 and INT12, log-grid INT4 (layouts in blocks.py).
 * Inputs are fp32 or bf16; outputs of dequantization fp32 or bf16 (rounded to nearest
 * even, as torch's conversion does). Every function takes [rows, n] row-major data and
 * splits the blocks over `threads` OpenMP threads.
 *
 * Exactness notes: the per-block inverse is `divisor * (1 / absmax)` and every code is
 * round-half-even(x * inverse), as in torch; absmax is taken on the bit patterns of |x|
 * (for non-negative floats integer order is float order, NaN above inf, +0.0 for an
 * all-zero block), which vectorises without -ffast-math.
 */
#include <stdint.h>
#include <string.h>

enum { FORMAT_INT8 = 0, FORMAT_INT4 = 1, FORMAT_LOG4 = 2, FORMAT_INT12 = 3 };
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
#define MAX_BLOCK 4096

typedef struct {
    const void *input;
    void *output;
    int64_t rows, numel, block_size, row_stride_bytes;
    int format, dtype;
} Job;

static inline float bits_to_float(uint32_t bits) { float value; memcpy(&value, &bits, 4); return value; }
static inline uint32_t float_to_bits(float value) { uint32_t bits; memcpy(&bits, &value, 4); return bits; }

static inline uint16_t float_to_bfloat16(float value) {
    uint32_t bits = float_to_bits(value);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  /* NaN, as c10 writes it */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Round half to even for |x| < 2^22: adding and subtracting 1.5 * 2^23 leaves the integer
 * in the mantissa under the default rounding mode. */
static inline float round_even(float x) { return (x + 12582912.0f) - 12582912.0f; }

static inline float max_code_of(int format) {
    return format == FORMAT_INT8 ? 127.0f : format == FORMAT_INT4 ? 7.0f : format == FORMAT_INT12 ? 2047.0f : 1.0f;
}

static inline int64_t bits_of(int format) { return format == FORMAT_INT8 ? 8 : format == FORMAT_INT12 ? 12 : 4; }

/* The block's values as fp32: fp32 input is read in place, bf16 widened into `buffer`. */
static const float *load_block(const Job *job, int64_t row, int64_t block, float *buffer) {
    int64_t offset = row * job->numel + block * job->block_size;
    if (job->dtype == DTYPE_FLOAT32) return (const float *)job->input + offset;
    const uint16_t *source = (const uint16_t *)job->input + offset;
    for (int64_t i = 0; i < job->block_size; i++) buffer[i] = bits_to_float((uint32_t)source[i] << 16);
    return buffer;
}

static inline uint8_t log_offset_code(float scaled) {
    uint32_t bits = float_to_bits(scaled);
    int32_t exponent = (int32_t)((bits >> 23) & 0xFF), top = (int32_t)((bits >> 22) & 1);
    int32_t magnitude = exponent + top - 120;
    magnitude = magnitude < 1 ? 1 : magnitude > 7 ? 7 : magnitude;
    magnitude = exponent >= 120 ? magnitude : 0;
    return (uint8_t)((bits >> 31) ? 8 - magnitude : 8 + magnitude);
}

static void quantize_block(const Job *job, int64_t row, int64_t block) {
    const int64_t size = job->block_size, half = size / 2;
    float buffer[MAX_BLOCK];
    const float *restrict values = load_block(job, row, block, buffer);
    uint32_t largest = 0;
    for (int64_t i = 0; i < size; i++) {
        uint32_t magnitude = float_to_bits(values[i]) & 0x7FFFFFFFu;
        largest = magnitude > largest ? magnitude : largest;
    }
    const float absmax = bits_to_float(largest), divisor = max_code_of(job->format);
    /* torch evaluates `divisor / absmax` (a number over a tensor) as divisor * (1 / absmax) */
    const float inverse = absmax > 0.0f ? divisor * (1.0f / absmax) : 0.0f;
    uint8_t *row_out = (uint8_t *)job->output + row * job->row_stride_bytes;
    const int64_t code_bytes = job->numel * bits_of(job->format) / 8;
    const float scale = absmax / divisor;
    memcpy(row_out + code_bytes + block * sizeof(float), &scale, sizeof(float));
    if (job->format == FORMAT_INT8) {
        int8_t *restrict codes = (int8_t *)row_out + block * size;
        for (int64_t i = 0; i < size; i++) codes[i] = (int8_t)(int32_t)round_even(values[i] * inverse);
        return;
    }
    if (job->format == FORMAT_INT12) {  /* elements j and j + B/2 share three bytes */
        uint8_t *restrict codes = row_out + block * half * 3;
        for (int64_t j = 0; j < half; j++) {
            int32_t low = (int32_t)round_even(values[j] * inverse) + 2048;
            int32_t high = (int32_t)round_even(values[j + half] * inverse) + 2048;
            codes[3 * j] = (uint8_t)(low & 0xFF);
            codes[3 * j + 1] = (uint8_t)((low >> 8) | ((high & 0xF) << 4));
            codes[3 * j + 2] = (uint8_t)(high >> 4);
        }
        return;
    }
    uint8_t *restrict codes = row_out + block * half;  /* element j low nibble, element j + B/2 high */
    if (job->format == FORMAT_INT4) {
        for (int64_t j = 0; j < half; j++)
            codes[j] = (uint8_t)(((int32_t)round_even(values[j] * inverse) + 8)
                                 | (((int32_t)round_even(values[j + half] * inverse) + 8) << 4));
        return;
    }
    for (int64_t j = 0; j < half; j++)
        codes[j] = (uint8_t)(log_offset_code(values[j] * inverse) | (log_offset_code(values[j + half] * inverse) << 4));
}

/* Where a block's fp32 values go: fp32 output in place, bf16 through `buffer` (then narrowed). */
static float *block_target(const Job *job, int64_t row, int64_t block, float *buffer) {
    int64_t offset = row * job->numel + block * job->block_size;
    return job->dtype == DTYPE_FLOAT32 ? (float *)job->output + offset : buffer;
}

static void narrow_block(const Job *job, int64_t row, int64_t block, const float *buffer) {
    if (job->dtype == DTYPE_FLOAT32) return;
    uint16_t *target = (uint16_t *)job->output + row * job->numel + block * job->block_size;
    for (int64_t i = 0; i < job->block_size; i++) target[i] = float_to_bfloat16(buffer[i]);
}

static inline float log_level(int32_t offset_code) {
    int32_t code = offset_code - 8, magnitude = code < 0 ? -code : code;
    /* sign(code) * 2^(|code| - 7) built from its bits; 0 for code 0 */
    uint32_t bits = magnitude ? ((uint32_t)(magnitude + 120) << 23) | (code < 0 ? 0x80000000u : 0u) : 0u;
    return bits_to_float(bits);
}

static void dequantize_block(const Job *job, int64_t row, int64_t block) {
    const int64_t size = job->block_size, half = size / 2;
    const uint8_t *row_in = (const uint8_t *)job->input + row * job->row_stride_bytes;
    const int64_t code_bytes = job->numel * bits_of(job->format) / 8;
    float scale, buffer[MAX_BLOCK];
    memcpy(&scale, row_in + code_bytes + block * sizeof(float), sizeof(float));
    float *restrict values = block_target(job, row, block, buffer);
    if (job->format == FORMAT_INT8) {
        const int8_t *restrict codes = (const int8_t *)row_in + block * size;
        for (int64_t i = 0; i < size; i++) values[i] = (float)codes[i] * scale;
    } else if (job->format == FORMAT_INT12) {
        const uint8_t *restrict codes = row_in + block * half * 3;
        for (int64_t j = 0; j < half; j++) {
            int32_t low = codes[3 * j] | ((codes[3 * j + 1] & 0xF) << 8);
            int32_t high = (codes[3 * j + 1] >> 4) | (codes[3 * j + 2] << 4);
            values[j] = (float)(low - 2048) * scale;
            values[j + half] = (float)(high - 2048) * scale;
        }
    } else if (job->format == FORMAT_INT4) {
        const uint8_t *restrict codes = row_in + block * half;
        for (int64_t j = 0; j < half; j++) {
            values[j] = (float)((int32_t)(codes[j] & 0xF) - 8) * scale;
            values[j + half] = (float)((int32_t)(codes[j] >> 4) - 8) * scale;
        }
    } else {
        const uint8_t *restrict codes = row_in + block * half;
        for (int64_t j = 0; j < half; j++) {
            values[j] = log_level(codes[j] & 0xF) * scale;
            values[j + half] = log_level(codes[j] >> 4) * scale;
        }
    }
    narrow_block(job, row, block, values);
}

#define MAX_THREADS 64

/* OpenMP, not threads of our own: this library's libgomp.so.1 resolves to the copy torch
 * has loaded, so the blocks run on torch's own worker threads. Threads of our own ran
 * beside torch's, which spin for a while after each of its parallel operations, and got no
 * speed-up from a second core. */
static int run_blocks(const Job *job, void (*block_fn)(const Job *, int64_t, int64_t), int threads) {
    if (job->block_size < 2 || job->block_size > MAX_BLOCK || job->block_size % 2 || job->numel % job->block_size)
        return -1;
    const int64_t blocks_per_row = job->numel / job->block_size, total = job->rows * blocks_per_row;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (total < 256 * threads) threads = 1;  /* waking a worker costs more than a few blocks */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++)  /* thread t takes global blocks [total t / T, total (t + 1) / T) */
        for (int64_t index = total * t / threads; index < total * (t + 1) / threads; index++)
            block_fn(job, index / blocks_per_row, index % blocks_per_row);
    return 0;
}

/* values [rows, numel] (dtype) -> packed [rows, row_stride_bytes] = [codes | fp32 scales] */
int zeropp_quantize(const void *values, uint8_t *packed, int64_t rows, int64_t numel, int64_t block_size,
                    int64_t row_stride_bytes, int format, int dtype, int threads) {
    Job job = {values, packed, rows, numel, block_size, row_stride_bytes, format, dtype};
    return run_blocks(&job, quantize_block, threads);
}

/* packed [rows, row_stride_bytes] -> values [rows, numel] (dtype) */
int zeropp_dequantize(const uint8_t *packed, void *values, int64_t rows, int64_t numel, int64_t block_size,
                      int64_t row_stride_bytes, int format, int dtype, int threads) {
    Job job = {packed, values, rows, numel, block_size, row_stride_bytes, format, dtype};
    return run_blocks(&job, dequantize_block, threads);
}
