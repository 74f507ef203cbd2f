// Both ends of a decode step's RemoteAttend on a shared-memory ring, one call each (the
// ring's layout: kvd/node/attention_ring.py):
//
// - kvd_ring_lane_post (the debtor): write a layer's request, the step's header with its
//   id and layer, and its frames, into the request slot (kvd/node/remote_attention.py's
//   StepLane);
// - kvd_ring_lane_take (the debtor): copy a reply that is exactly the ok RemotePartials
//   expected into the step's gather;
// - kvd_ring_lane_serve (the creditor): answer a request of the step in one call
//   (kvd/node/ring_lane.py), below.
//
// A debtor's messages for one remote part of one decode step differ only in their id and
// layer (kvd/node/step_template.py). Once the creditor has decoded, checked and served
// one of them in full, the rest of the step is this: check that the request slot holds a
// message whose header is the served one's but for a plain id and a plain decimal layer,
// with frames of the same sizes; write its one K/V row into the lent part's caches; run
// the part's micro-attention (the paged attention kernel, through the pointer the caller
// passes) over the request's query with the reply slot's frames as its output; write the
// reply's header (what protocol.encode writes for an ok RemotePartials of that shape and
// id) and the slot's head. Anything else is left to the caller (nothing written).
//
// Everything a message cannot change (the caches' and the rows' addresses, the kernel's
// layout, the reply's shape) is fixed by the caller in a Lane, from the message it served
// in full: no byte of a request picks an address but its layer, checked against the
// layer count.

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kAlign = 64;
constexpr int kMaxFrames = 4;
constexpr int kMaxId = 64;
constexpr int kMaxLayerDigits = 6;

// A slot's head (kvd/node/attention_ring.py's _SLOT: "<IIII4Q").
struct SlotHead {
    uint32_t seq, header_bytes, frames, zero;
    uint64_t sizes[kMaxFrames];
};
static_assert(sizeof(SlotHead) == 48, "a slot's head is 48 bytes");

using PartialsFn = int (*)(const float*, int64_t, const void*, const void*, int, int64_t, int, const int64_t*,
                           const int64_t*, const int64_t*, const int64_t*, const int64_t*, const int64_t*, int,
                           int64_t, int, int, int, int, float, int64_t, int64_t, float*, float*, float*, int);

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool id_char(uint8_t c) {
    return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_' || c == '-';
}

}  // namespace

extern "C" {

// A step's request of one remote part: header = pre + ID + mid + LAYER + post (ID
// [0-9A-Za-z_-]{1,64}, LAYER 0|[1-9][0-9]{0,5}), then `frames` frames of `sizes` bytes.
struct KvdRequestPattern {
    const uint8_t* pre;
    int64_t pre_len;
    const uint8_t* mid;
    int64_t mid_len;
    const uint8_t* post;
    int64_t post_len;
    int64_t frames;
    int64_t sizes[kMaxFrames];
};

// What the debtor posts (kvd/node/attention_ring.py's StepRequest): the pattern and its
// frames' addresses.
struct KvdRingPost {
    KvdRequestPattern pattern;
    int64_t data[kMaxFrames];
};

// Write request `seq` into `slot` (`slot_bytes` long): the header pre + id + mid + layer in
// decimal + post, then the frames, each 64-byte aligned, then the slot's head. Returns 0, or
// 1 (nothing written) when it does not fit, the id is not 1 to 64 bytes or the layer negative.
int kvd_ring_lane_post(uint8_t* slot, int64_t slot_bytes, uint32_t seq, const KvdRingPost* p, const uint8_t* id,
                       int64_t id_len, int64_t layer) {
    const KvdRequestPattern& pt = p->pattern;
    if (id_len < 1 || id_len > kMaxId || layer < 0 || pt.frames < 0 || pt.frames > kMaxFrames) return 1;
    char digits[24];
    int n = 0;
    do digits[n++] = char('0' + layer % 10), layer /= 10; while (layer);
    const int64_t hlen = pt.pre_len + id_len + pt.mid_len + n + pt.post_len;
    int64_t use = kAlign + align_up(hlen);
    for (int64_t f = 0; f < pt.frames; f++) use += align_up(pt.sizes[f]);
    if (use > slot_bytes) return 1;
    uint8_t* h = slot + kAlign;
    std::memcpy(h, pt.pre, pt.pre_len), h += pt.pre_len;
    std::memcpy(h, id, id_len), h += id_len;
    std::memcpy(h, pt.mid, pt.mid_len), h += pt.mid_len;
    while (n) *h++ = uint8_t(digits[--n]);
    std::memcpy(h, pt.post, pt.post_len);
    uint8_t* frame = slot + kAlign + align_up(hlen);
    SlotHead head{seq, uint32_t(hlen), uint32_t(pt.frames), 0, {0, 0, 0, 0}};
    for (int64_t f = 0; f < pt.frames; f++) {
        std::memcpy(frame, reinterpret_cast<const void*>(p->data[f]), pt.sizes[f]);
        frame += align_up(pt.sizes[f]);
        head.sizes[f] = uint64_t(pt.sizes[f]);
    }
    std::memcpy(slot, &head, sizeof head);
    return 0;
}

// Where a reply of one shape goes (kvd/node/attention_ring.py's RingClient.next_reply_into):
// the ok RemotePartials' header around its id, its rows x chunks x heads (x head_dim), and
// where its rows go: row r to m + r * ld_ml, l + r * ld_ml, o + r * ld_o (floats).
struct KvdRingTake {
    const uint8_t* rpre;
    int64_t rpre_len;
    const uint8_t* rpost;
    int64_t rpost_len;
    int64_t rows, chunks, heads, head_dim;
    float* m;
    float* l;
    float* o;
    int64_t ld_ml, ld_o;
};

// Copy reply `seq` from `slot` (`slot_bytes` long) into t's places when it is exactly the ok
// RemotePartials answering `id` of t's shape: its header rpre + id + rpost, three fp32 frames
// of those sizes. Returns 0, or 1 (nothing copied).
int kvd_ring_lane_take(const uint8_t* slot, int64_t slot_bytes, uint32_t seq, const KvdRingTake* t,
                       const uint8_t* id, int64_t id_len) {
    SlotHead head;
    std::memcpy(&head, slot, sizeof head);
    const int64_t ml = t->rows * t->chunks * t->heads * 4, ob = ml * t->head_dim;
    const int64_t hlen = t->rpre_len + id_len + t->rpost_len;
    if (head.seq != seq || head.frames != 3 || int64_t(head.header_bytes) != hlen || head.sizes[0] != uint64_t(ml)
        || head.sizes[1] != uint64_t(ml) || head.sizes[2] != uint64_t(ob))
        return 1;
    if (kAlign + align_up(hlen) + 2 * align_up(ml) + align_up(ob) > slot_bytes) return 1;
    const uint8_t* h = slot + kAlign;
    if (std::memcmp(h, t->rpre, t->rpre_len) != 0 || std::memcmp(h + t->rpre_len, id, id_len) != 0
        || std::memcmp(h + t->rpre_len + id_len, t->rpost, t->rpost_len) != 0)
        return 1;
    const float* fm = reinterpret_cast<const float*>(slot + kAlign + align_up(hlen));
    const float* fl = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(fm) + align_up(ml));
    const float* fo = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(fl) + align_up(ml));
    const int64_t row_ml = t->chunks * t->heads, row_o = row_ml * t->head_dim;
    for (int64_t r = 0; r < t->rows; r++) {
        std::memcpy(t->m + r * t->ld_ml, fm + r * row_ml, row_ml * 4);
        std::memcpy(t->l + r * t->ld_ml, fl + r * row_ml, row_ml * 4);
        std::memcpy(t->o + r * t->ld_o, fo + r * row_o, row_o * 4);
    }
    return 0;
}

// One step's lane (kvd/node/ring_lane.py mirrors it field for field, every field 8 bytes).
struct KvdRingLane {
    KvdRequestPattern request;      // the served request's, its frames q, k, v
    // the reply: header = rpre + ID + rpost, then frames m, l, o of rsizes
    const uint8_t* rpre;
    int64_t rpre_len;
    const uint8_t* rpost;
    int64_t rpost_len;
    int64_t rsizes[3];
    // the K/V row (frames 1 and 2, row_bytes each) goes to k_dst[layer], v_dst[layer]
    int64_t layers;
    const int64_t* k_dst;
    const int64_t* v_dst;
    int64_t row_bytes;
    // the kernel (kvd_paged_attention_partials) and its arguments; kc, vc, window per layer
    void* partials;
    const int64_t* kc;
    const int64_t* vc;
    const int64_t* window;
    int64_t kv_half, num_blocks, sequences;
    const int64_t* q_start;
    const int64_t* q_len;
    const int64_t* ctx_len;
    const int64_t* chunk_lo;
    const int64_t* chunk_hi;
    const int64_t* tables;
    int64_t max_blocks, rows, heads, kv_heads, head_dim, block_size;
    double scale;
    int64_t slots, threads;
};

// Answer request `seq` in `request` (its slot) into `reply` (its reply slot), both
// `slot_bytes` long. Returns 0 (the reply slot holds the answer, head last: post its
// doorbell), 1 (the request is not the lane's message: nothing written), or -1 (the
// kernel refused the lane's layout: the K/V row written, nothing posted).
int kvd_ring_lane_serve(const KvdRingLane* lane, const uint8_t* request, uint8_t* reply, uint32_t seq,
                        int64_t slot_bytes) {
    const KvdRequestPattern& req = lane->request;
    SlotHead head;
    std::memcpy(&head, request, sizeof head);
    if (head.seq != seq || head.frames != uint64_t(req.frames)) return 1;
    for (int64_t f = 0; f < req.frames; f++)
        if (head.sizes[f] != uint64_t(req.sizes[f])) return 1;
    const int64_t hlen = head.header_bytes;
    int64_t use = kAlign + align_up(hlen);
    for (int64_t f = 0; f < req.frames; f++) use += align_up(req.sizes[f]);
    if (use > slot_bytes) return 1;
    // the header: pre, an id, mid, a layer, post; and nothing else
    const uint8_t* h = request + kAlign;
    const int64_t fixed = req.pre_len + req.mid_len + req.post_len;
    if (hlen < fixed + 2 || std::memcmp(h, req.pre, req.pre_len) != 0) return 1;
    int64_t at = req.pre_len, id_len = 0;
    while (id_len <= kMaxId && at + id_len < hlen && id_char(h[at + id_len])) id_len++;
    if (id_len < 1 || id_len > kMaxId) return 1;
    const uint8_t* id = h + at;
    at += id_len;
    if (at + req.mid_len > hlen || std::memcmp(h + at, req.mid, req.mid_len) != 0) return 1;
    at += req.mid_len;
    int64_t layer = 0, digits = 0;
    while (digits <= kMaxLayerDigits && at + digits < hlen && h[at + digits] >= '0' && h[at + digits] <= '9')
        layer = layer * 10 + (h[at + digits] - '0'), digits++;
    if (digits < 1 || digits > kMaxLayerDigits || (digits > 1 && h[at] == '0')) return 1;
    at += digits;
    if (at + req.post_len != hlen || std::memcmp(h + at, req.post, req.post_len) != 0) return 1;
    if (layer >= lane->layers) return 1;
    // the reply's place
    const int64_t rlen = lane->rpre_len + id_len + lane->rpost_len;
    if (kAlign + align_up(rlen) + align_up(lane->rsizes[0]) + align_up(lane->rsizes[1]) + align_up(lane->rsizes[2])
        > slot_bytes)
        return 1;
    // the frames: q, then the K/V row
    const uint8_t* frame = request + kAlign + align_up(hlen);
    const float* q = reinterpret_cast<const float*>(frame);
    const uint8_t* k = frame + align_up(req.sizes[0]);
    const uint8_t* v = k + align_up(req.sizes[1]);
    std::memcpy(reinterpret_cast<void*>(lane->k_dst[layer]), k, lane->row_bytes);
    std::memcpy(reinterpret_cast<void*>(lane->v_dst[layer]), v, lane->row_bytes);
    uint8_t* out = reply + kAlign;
    float* m = reinterpret_cast<float*>(out + align_up(rlen));
    float* l = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(m) + align_up(lane->rsizes[0]));
    float* o = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(l) + align_up(lane->rsizes[1]));
    const int rc = reinterpret_cast<PartialsFn>(lane->partials)(
        q, lane->heads * lane->head_dim, reinterpret_cast<const void*>(lane->kc[layer]),
        reinterpret_cast<const void*>(lane->vc[layer]), int(lane->kv_half), lane->num_blocks, int(lane->sequences),
        lane->q_start, lane->q_len, lane->ctx_len, lane->chunk_lo, lane->chunk_hi, lane->tables,
        int(lane->max_blocks), lane->rows, int(lane->heads), int(lane->kv_heads), int(lane->head_dim),
        int(lane->block_size), float(lane->scale), lane->window[layer], lane->slots, m, l, o, int(lane->threads));
    if (rc != 0) return -1;
    std::memcpy(out, lane->rpre, lane->rpre_len);
    std::memcpy(out + lane->rpre_len, id, id_len);
    std::memcpy(out + lane->rpre_len + id_len, lane->rpost, lane->rpost_len);
    SlotHead done{seq, uint32_t(rlen), 3, 0, {uint64_t(lane->rsizes[0]), uint64_t(lane->rsizes[1]),
                                              uint64_t(lane->rsizes[2]), 0}};
    std::memcpy(reply, &done, sizeof done);
    return 0;
}

}  // extern "C"
