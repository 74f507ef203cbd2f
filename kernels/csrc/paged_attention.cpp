// Attention of a step's query rows over their sequences' paged KV, for the torch path of an
// fp32 model: a prefill's rows (any chunk of a prompt, any cached prefix) and a decode
// batch's rows alike. Each row is computed by attention_rows.h's functions, in the order the
// plan executor's decode step uses for it: a token's attention output is the same bits here
// and there, whatever the chunk, the batch, the thread count or the build.
//
// Called through ctypes from kernels/paged_attention.py, which documents the contract.
// Layouts:
//
//     q      [T, H, hd]                  row stride ldq: rotated queries, a row's heads contiguous
//     kc, vc [N, bs, KVH, hd]            the layer's K and V caches, fp32 or IEEE halves (kv_half);
//                                        every key a row reads is written already
//     out    [T, H, hd]                  row stride ldo
//
// Sequence s owns rows q_start[s] .. q_start[s] + q_len[s] - 1, at positions ctx_len[s] -
// q_len[s] .. ctx_len[s] - 1, and its block table is tables[s * max_blocks ...]. Row r at
// position p attends to keys 0..p (causal), or on a sliding layer of `window` keys to keys
// max(0, p - window + 1)..p.
//
// Work: rows are taken ROWS_PER_PASS at a time; a pass hands out (key chunk, row) items to
// the team (attend_chunk), then (row, head) pairs to combine them (combine_chunks). Which
// thread takes what changes nothing in any row.

#include <omp.h>

#include <algorithm>
#include <vector>

#include "attention_rows.h"

namespace {

// Rows per pass: bounds the items' partial results (m, l, o per row and chunk: H * (hd + 2)
// floats each, a row having key_chunks(ctx, window) of them).
constexpr int64_t ROWS_PER_PASS = 64;

struct RowRef {
    const float* q;                     // its rotated queries [H][hd]
    const int64_t* table;
    int64_t ctx;                        // its position + 1
    int64_t first;                      // its first chunk (first_chunk)
    float* out;
};

template <class KV>
void run(const std::vector<RowRef>& rows, const KV* kc, const KV* vc, int H, int KVH, int hd, int bs,
         float scale, int64_t window, int nt) {
    const int64_t kvh_stride = (int64_t)KVH * hd, q_size = (int64_t)H * hd;
    std::vector<int64_t> item_row, item_chunk;
    std::vector<float> part_m, part_l, part_o;
    for (size_t a = 0; a < rows.size(); a += ROWS_PER_PASS) {
        const size_t b = a + ROWS_PER_PASS < rows.size() ? a + ROWS_PER_PASS : rows.size();
        // items chunk by chunk, each chunk for every row that has it: the rows of a prompt
        // read one chunk's K and V rows in turn while they are in cache. Row r's chunk c
        // leaves its results at slot (r - a) * chunks + c - its first chunk.
        int64_t chunks = 0, last = 0;
        for (size_t r = a; r < b; r++) {
            chunks = std::max(chunks, key_chunks(rows[r].ctx, window));
            last = std::max(last, (rows[r].ctx - 1) / KEY_CHUNK);
        }
        item_row.clear(), item_chunk.clear();
        for (int64_t c = 0; c <= last; c++)
            for (size_t r = a; r < b; r++)
                if (c >= rows[r].first && c * KEY_CHUNK < rows[r].ctx) item_row.push_back((int64_t)r), item_chunk.push_back(c);
        const int64_t items = (int64_t)item_row.size(), pairs = (int64_t)(b - a) * H;
        const size_t slots = (b - a) * (size_t)chunks;
        part_m.resize(slots * H), part_l.resize(slots * H), part_o.resize(slots * q_size);
#pragma omp parallel num_threads(nt)
        {
            std::vector<float> scores((size_t)H * KEY_CHUNK);
#pragma omp for schedule(dynamic, 4)
            for (int64_t i = 0; i < items; i++) {
                const RowRef& row = rows[(size_t)item_row[i]];
                const int64_t c = item_chunk[i];
                const size_t slot = (size_t)(item_row[i] - (int64_t)a) * chunks + (c - row.first);
                attend_chunk<false>(AttnSeq{row.q, row.table, row.ctx}, chunk_start(c, row.ctx, window),
                                    chunk_end(c, row.ctx), kc, vc, bs, kvh_stride, H, H / KVH,
                                    hd, scale, scores.data(), &part_m[slot * H], &part_l[slot * H],
                                    &part_o[slot * q_size]);
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t r = p / H, head = p % H;
                const size_t slot = (size_t)r * chunks;
                combine_chunks(&part_m[slot * H + head], &part_l[slot * H + head], &part_o[slot * q_size + head * hd],
                               key_chunks(rows[a + r].ctx, window), H, hd, rows[a + r].out + head * hd);
            }
        }
    }
}

}  // namespace

extern "C" {

const char* kvd_paged_attention_variant() { return KVD_VARIANT; }

// out = each row's attention (layouts above). Returns 0, or -1 (nothing written) for a shape
// the functions do not take (H not a multiple of KVH, hd not a multiple of 16 or above 256, a
// row stride shorter than a row, a negative window), a sequence whose rows do not fit its
// context or the step's T rows, or a block id out of [0, num_blocks) among those its keys use.
// window: the layer's sliding window in keys, 0 for none.
int kvd_paged_attention(const float* q, int64_t ldq, const void* kc, const void* vc, int kv_half,
                        int64_t num_blocks, int S, const int64_t* q_start, const int64_t* q_len,
                        const int64_t* ctx_len, const int64_t* tables, int max_blocks, int64_t T, int H, int KVH,
                        int hd, int bs, float scale, int64_t window, float* out, int64_t ldo, int num_threads) {
    if (window < 0 || S < 0 || KVH < 1 || H < KVH || H % KVH || hd < 16 || hd % 16 || hd > 256 || bs < 1) return -1;
    if (ldq < (int64_t)H * hd || ldo < (int64_t)H * hd) return -1;
    std::vector<RowRef> rows;
    for (int s = 0; s < S; s++) {
        if (q_len[s] < 0 || ctx_len[s] < q_len[s] || q_start[s] < 0 || q_start[s] + q_len[s] > T) return -1;
        if ((ctx_len[s] + bs - 1) / bs > max_blocks) return -1;
        const int64_t* table = tables + (size_t)s * max_blocks;
        const int64_t first_block = q_len[s] ? first_key(ctx_len[s] - q_len[s] + 1, window) / bs : 0;
        for (int64_t j = first_block; j < (ctx_len[s] + bs - 1) / bs; j++)
            if (table[j] < 0 || table[j] >= num_blocks) return -1;
        for (int64_t i = 0; i < q_len[s]; i++) {
            const int64_t row = q_start[s] + i;
            const int64_t ctx = ctx_len[s] - q_len[s] + i + 1;
            rows.push_back({q + row * ldq, table, ctx, first_chunk(ctx, window), out + row * ldo});
        }
    }
    const int nt = num_threads < 1 ? 1 : num_threads;
    if (kv_half)
        run(rows, (const uint16_t*)kc, (const uint16_t*)vc, H, KVH, hd, bs, scale, window, nt);
    else
        run(rows, (const float*)kc, (const float*)vc, H, KVH, hd, bs, scale, window, nt);
    return 0;
}

}  // extern "C"

// ------------------------------------------------------------------ DistAttention
// Infinite-LLM §4.2: a sequence's keys in parts (micro-attentions), each part a range of whole
// key chunks [chunk_lo * KEY_CHUNK, chunk_hi * KEY_CHUNK) held by one KV memory (this node's
// blocks, or blocks lent by another node). kvd_paged_attention_partials leaves each row's
// per-chunk results (m, l, o: attend_chunk's) of the chunks in its part, uncombined;
// kvd_attention_combine combines a row's chunks, gathered from every part into one array in
// chunk order, by combine_chunks. Each chunk's results are attend_chunk's bits whichever
// memory computed them, and combine_chunks reads them in the same order as kvd_paged_attention:
// the output is the unsplit kernel's, bit for bit. Layouts (C slots a row, slot = chunk -
// chunk_lo of the row's sequence):
//
//     m, l   [T, C, H]        o   [T, C, H, hd]
//
// A slot a row does not attend to (past its position, before its window, or past the part)
// holds m = -inf, l = 0, o = 0 after kvd_paged_attention_partials; combine never reads one.

namespace {

template <class KV>
void run_partials(const std::vector<RowRef>& rows, const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                  const KV* kc, const KV* vc, int H, int KVH, int hd, int bs, float scale, int64_t window,
                  int64_t C, float* m, float* l, float* o, int nt) {
    const int64_t kvh_stride = (int64_t)KVH * hd, q_size = (int64_t)H * hd;
    std::vector<int64_t> item_row, item_chunk;
    for (size_t r = 0; r < rows.size(); r++) {
        const int64_t last = std::min(hi[r], (rows[r].ctx - 1) / KEY_CHUNK + 1);
        for (int64_t c = std::max(lo[r], rows[r].first); c < last; c++) item_row.push_back((int64_t)r), item_chunk.push_back(c);
    }
    const int64_t items = (int64_t)item_row.size(), slots = (int64_t)rows.size() * C;
#pragma omp parallel num_threads(nt)
    {
        // every slot empty first: the items then fill theirs
#pragma omp for schedule(static)
        for (int64_t s = 0; s < slots; s++) {
            for (int h = 0; h < H; h++) m[s * H + h] = -INFINITY, l[s * H + h] = 0.0f;
            memset(o + s * q_size, 0, (size_t)q_size * sizeof(float));
        }
        std::vector<float> scores((size_t)H * KEY_CHUNK);
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < items; i++) {
            const size_t r = (size_t)item_row[i];
            const RowRef& row = rows[r];
            const int64_t c = item_chunk[i], slot = (int64_t)r * C + c - lo[r];
            attend_chunk<false>(AttnSeq{row.q, row.table, row.ctx}, chunk_start(c, row.ctx, window),
                                chunk_end(c, row.ctx), kc, vc, bs, kvh_stride, H, H / KVH, hd, scale,
                                scores.data(), m + slot * H, l + slot * H, o + slot * q_size);
        }
    }
}

}  // namespace

extern "C" {

// m, l, o = the per-chunk results of each row's chunks in its sequence's part [chunk_lo[s],
// chunk_hi[s]) (layouts above; q, the caches, q_start, q_len, ctx_len and tables as
// kvd_paged_attention's: tables give the blocks of the part's keys, other entries are not
// read). Returns 0, or -1 (nothing written) for kvd_paged_attention's reasons, a part that is
// empty, does not start at or past chunk 0 or has more than C chunks, or a block id out of
// range among those the part's keys use.
int kvd_paged_attention_partials(const float* q, int64_t ldq, const void* kc, const void* vc, int kv_half,
                                 int64_t num_blocks, int S, const int64_t* q_start, const int64_t* q_len,
                                 const int64_t* ctx_len, const int64_t* chunk_lo, const int64_t* chunk_hi,
                                 const int64_t* tables, int max_blocks, int64_t T, int H, int KVH, int hd, int bs,
                                 float scale, int64_t window, int64_t C, float* m, float* l, float* o,
                                 int num_threads) {
    if (window < 0 || S < 0 || C < 1 || KVH < 1 || H < KVH || H % KVH || hd < 16 || hd % 16 || hd > 256 || bs < 1)
        return -1;
    if (ldq < (int64_t)H * hd) return -1;
    std::vector<RowRef> rows(T, RowRef{nullptr, nullptr, 1, 0, nullptr});
    std::vector<int64_t> lo(T, 0), hi(T, 0);
    for (int s = 0; s < S; s++) {
        if (q_len[s] < 0 || ctx_len[s] < q_len[s] || q_start[s] < 0 || q_start[s] + q_len[s] > T) return -1;
        if (chunk_lo[s] < 0 || chunk_hi[s] <= chunk_lo[s] || chunk_hi[s] - chunk_lo[s] > C) return -1;
        if ((ctx_len[s] + bs - 1) / bs > max_blocks) return -1;
        const int64_t* table = tables + (size_t)s * max_blocks;
        if (q_len[s]) {
            const int64_t k0 = std::max(first_key(ctx_len[s] - q_len[s] + 1, window), chunk_lo[s] * KEY_CHUNK);
            const int64_t k1 = std::min(ctx_len[s], chunk_hi[s] * KEY_CHUNK);
            for (int64_t j = k0 / bs; k0 < k1 && j < (k1 + bs - 1) / bs; j++)
                if (table[j] < 0 || table[j] >= num_blocks) return -1;
        }
        for (int64_t i = 0; i < q_len[s]; i++) {
            const int64_t row = q_start[s] + i, ctx = ctx_len[s] - q_len[s] + i + 1;
            if (rows[row].q != nullptr) return -1;          // two sequences claim one row
            rows[row] = {q + row * ldq, table, ctx, first_chunk(ctx, window), nullptr};
            lo[row] = chunk_lo[s], hi[row] = chunk_hi[s];
        }
    }
    // rows no sequence claims: their slots are emptied, nothing is read for them
    for (int64_t r = 0; r < T; r++)
        if (rows[r].q == nullptr) rows[r].first = 0, lo[r] = 0, hi[r] = 0;
    const int nt = num_threads < 1 ? 1 : num_threads;
    if (kv_half)
        run_partials(rows, lo, hi, (const uint16_t*)kc, (const uint16_t*)vc, H, KVH, hd, bs, scale, window, C, m, l,
                     o, nt);
    else
        run_partials(rows, lo, hi, (const float*)kc, (const float*)vc, H, KVH, hd, bs, scale, window, C, m, l, o, nt);
    return 0;
}

// out = each row's attention from its chunks' results (layouts above; chunk_lo[s]: the chunk
// of slot 0 of sequence s's rows). Row r at position p combines the slots of its chunks,
// first_chunk(p + 1, window) .. p / KEY_CHUNK, in chunk order. Returns 0, or -1 (nothing
// written) for a bad shape, a sequence whose rows do not fit its context or the T rows, or a
// row whose chunks fall outside its C slots.
int kvd_attention_combine(const float* m, const float* l, const float* o, int64_t C, int S, const int64_t* q_start,
                          const int64_t* q_len, const int64_t* ctx_len, const int64_t* chunk_lo, int64_t T, int H,
                          int hd, int64_t window, float* out, int64_t ldo, int num_threads) {
    if (window < 0 || S < 0 || C < 1 || H < 1 || hd < 16 || hd % 16 || hd > 256 || ldo < (int64_t)H * hd) return -1;
    std::vector<int64_t> row_of, first_of, count_of;
    for (int s = 0; s < S; s++) {
        if (q_len[s] < 0 || ctx_len[s] < q_len[s] || q_start[s] < 0 || q_start[s] + q_len[s] > T) return -1;
        for (int64_t i = 0; i < q_len[s]; i++) {
            const int64_t ctx = ctx_len[s] - q_len[s] + i + 1;
            const int64_t first = first_chunk(ctx, window) - chunk_lo[s], count = key_chunks(ctx, window);
            if (first < 0 || first + count > C) return -1;
            row_of.push_back(q_start[s] + i), first_of.push_back(first), count_of.push_back(count);
        }
    }
    const int64_t pairs = (int64_t)row_of.size() * H, q_size = (int64_t)H * hd;
    const int nt = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const size_t i = (size_t)(p / H);
        const int64_t head = p % H, slot = row_of[i] * C + first_of[i];
        combine_chunks(m + slot * H + head, l + slot * H + head, o + slot * q_size + head * hd, count_of[i], H, hd,
                       out + row_of[i] * ldo + head * hd);
    }
    return 0;
}

}  // extern "C"
