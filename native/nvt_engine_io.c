/*
 * nvt_engine_io: a worker's I/O thread (nvt_io_main, started by
 * nvt_engine_open): its loop and everything it does per op (take, hash or
 * seal, prep and submit SQEs, reap CQEs, continue short transfers, fail the
 * ops of a failed ring, publish completions). Runs on that worker's thread
 * only; it takes the worker's lock to take ops and the engine's lock to
 * publish, and blocks in the ring (below).
 *
 * Each round of an I/O thread: take pending ops (within the queue-depth and
 * byte caps), hash the writes and submit them, hash the reads reaped last
 * round, publish completions, then wait for at least one CQE and reap. Reads
 * are hashed after the ring was refilled so the device never idles while the
 * thread hashes.
 *
 * The I/O thread has a single wait point, io_uring_submit_and_wait(1). To be
 * woken for new ops it keeps a read on an eventfd armed in the ring; a
 * submitter writes the eventfd only when the thread said it may sleep with
 * nothing pending (`sleeping`), so a busy engine costs no wake-up syscalls.
 * A submit writes one such eventfd at most: the other idle workers it gave
 * ops to are left to the I/O threads (nvt_engine_relay_wakes, at the top of
 * each round, between two reads hashed or opened, and before the wait).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nvt_engine_internal.h"
#include "nvt_hash.h"

/* user_data of the eventfd read; op SQEs carry their slot index. */
#define NVT_WAKE_TAG UINT64_MAX
/* Hash this many write bytes, then submit what is prepped, so the first
 * writes of a large batch reach the device while the rest are hashed. */
#define NVT_SUBMIT_EVERY_BYTES (256ULL << 10)
/* Sealing engines: writes taken (and sealed) per round of the I/O thread. */
#define NVT_SEAL_BATCH 2u
/* A ring whose io_uring_enter fails this many times in a row (1 ms apart)
 * with an error that is not transient is declared failed. */
#define NVT_RING_FAIL_TRIES 100
/* An error that is normally transient (EAGAIN: no memory for requests,
 * EBUSY, EINTR, ETIME) that keeps coming with nothing completing is no
 * progress either: the thread backs off 1 ms from the second in a row (no
 * busy spin), and after this many in a row with no completion reaped the
 * ring is declared failed, so its ops fail and close() returns. */
#define NVT_RING_TRANSIENT_TRIES 1000
/* Once close began, a failed ring waits this long at most for the ops the
 * kernel took to come back; then they fail and the thread exits anyway (its
 * ring's teardown cancels them in the kernel), so close() always returns. */
#define NVT_STOP_GRACE_MS 5000

/* io_uring_submit, or the tests' injected failure (nvt_engine_inject_enter_error). */
static int io_submit(nvt_worker *w) {
    int inj = __atomic_load_n(&w->inject_enter_err, __ATOMIC_RELAXED);
    return inj ? -inj : io_uring_submit(&w->ring);
}

static struct io_uring_sqe *io_get_sqe(nvt_worker *w) {
    struct io_uring_sqe *sqe;
    /* The SQ holds qd + 1 entries and at most one SQE per slot plus the wake
     * read is ever unsubmitted, so this loop is a safety net. */
    while (!(sqe = io_uring_get_sqe(&w->ring))) {
        if (io_submit(w) < 0)
            usleep(1000);
    }
    return sqe;
}

static void io_arm_wake(nvt_worker *w) {
    struct io_uring_sqe *sqe = io_get_sqe(w);
    io_uring_prep_read(sqe, w->wake_fd, &w->wake_value, sizeof(w->wake_value), 0);
    io_uring_sqe_set_data64(sqe, NVT_WAKE_TAG);
    w->wake_armed = 1;
}

/* Prep the SQE moving the next part of slot `idx` (all of it, unless it
 * crosses a registered-buffer boundary or exceeds one SQE). */
static void io_prep(nvt_worker *w, unsigned idx) {
    nvt_engine *e = w->e;
    nvt_slot *s = &w->slots[idx];
    uint64_t off = (uint64_t)s->op.buf_offset + s->moved;
    uint64_t n = (uint64_t)s->op.length - s->moved;
    uint64_t file_off = (uint64_t)s->op.file_offset + s->moved;
    void *addr = e->buf + off;
    int fd = w->info.fixed_files ? (int)s->op.file_idx : e->fds[s->op.file_idx];
    struct io_uring_sqe *sqe = io_get_sqe(w);

    if (e->sealed) {
        /* The sealed slot: from its image (write), into its arena span or
         * else the row and the trailer page (readv); `moved` counts slot
         * bytes. */
        uint64_t slot = e->seal.slot_bytes, row = e->seal.row_bytes;
        file_off = (uint64_t)s->op.file_offset + s->moved;
        if (s->op.kind == NVT_OP_WRITE) {
            io_uring_prep_write(sqe, fd, nvt_seal_out(s) + s->moved, (unsigned)(slot - s->moved), file_off);
        } else if (s->stage) {
            io_uring_prep_read(sqe, fd, s->stage + s->moved, (unsigned)(slot - s->moved), file_off);
        } else {
            unsigned nv = 0;
            if (s->moved < row) {
                s->iov[nv].iov_base = e->buf + s->op.buf_offset + s->moved;
                s->iov[nv++].iov_len = (size_t)(row - s->moved);
                s->iov[nv].iov_base = s->trail;
                s->iov[nv++].iov_len = (size_t)(slot - row);
            } else {
                s->iov[nv].iov_base = s->trail + (s->moved - row);
                s->iov[nv++].iov_len = (size_t)(slot - s->moved);
            }
            io_uring_prep_readv(sqe, fd, s->iov, nv, file_off);
        }
    } else if (s->stage) {
        /* The arena is not registered: a plain transfer (its huge pages
         * pin in a few steps each). */
        addr = s->stage + s->moved;
        if (n > NVT_MAX_SQE_BYTES)
            n = NVT_MAX_SQE_BYTES;
        if (s->op.kind == NVT_OP_WRITE)
            io_uring_prep_write(sqe, fd, addr, (unsigned)n, file_off);
        else
            io_uring_prep_read(sqe, fd, addr, (unsigned)n, file_off);
    } else if (w->info.registered_buffers) {
        uint64_t chunk = e->cfg.register_chunk_bytes;
        uint64_t chunk_end = (off / chunk + 1) * chunk;
        int buf_index = (int)(off / chunk);
        if (n > chunk_end - off)
            n = chunk_end - off;
        if (s->op.kind == NVT_OP_WRITE)
            io_uring_prep_write_fixed(sqe, fd, addr, (unsigned)n, file_off, buf_index);
        else
            io_uring_prep_read_fixed(sqe, fd, addr, (unsigned)n, file_off, buf_index);
    } else {
        if (n > NVT_MAX_SQE_BYTES)
            n = NVT_MAX_SQE_BYTES;
        if (s->op.kind == NVT_OP_WRITE)
            io_uring_prep_write(sqe, fd, addr, (unsigned)n, file_off);
        else
            io_uring_prep_read(sqe, fd, addr, (unsigned)n, file_off);
    }
    if (w->info.fixed_files)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, idx);
}

static void io_count(nvt_worker *w, int64_t result) {
    __atomic_fetch_add(&w->n_ops, 1, __ATOMIC_RELAXED);
    if (result > 0)
        __atomic_fetch_add(&w->n_bytes, (uint64_t)result, __ATOMIC_RELAXED);
}

static void io_finish(nvt_worker *w, unsigned idx, int64_t result, uint64_t checksum) {
    nvt_slot *s = &w->slots[idx];
    if (s->stage) {
        /* A staged read that asked for no hash lands in the buffer now; a
         * failed op leaves the buffer untouched (as a direct op's might not). */
        if (s->op.kind == NVT_OP_READ && result > 0 && !w->e->sealed)
            nvt_copy(w->e->buf + s->op.buf_offset, s->stage, (size_t)s->op.length);
        nvt_stage_give(w, s->stage_first, s->stage_units);
        s->stage = NULL;
    }
    batch_reserve_hard(&w->out, 1);
    batch_push(&w->out, s->op.op_id, result, checksum);
    io_count(w, result);
    w->inflight_bytes -= (uint64_t)s->op.length;
    w->free_slots[w->n_free++] = idx;
}

static void io_on_cqe(nvt_worker *w, unsigned idx, int res) {
    nvt_slot *s = &w->slots[idx];
    nvt_engine *e = w->e;
    uint64_t length = e->sealed ? e->seal.slot_bytes : (uint64_t)s->op.length;

    if (res > 0) {
        s->moved += (uint64_t)res;
        if (s->moved < length) {
            /* Short transfer (or a capped SQE): continue with the rest. A
             * retry that moves nothing or fails ends the op with -EIO. A
             * failed ring submits nothing more: the op fails (short: -EIO). */
            if (w->sq_abandoned) {
                io_finish(w, idx, -EIO, 0);
                return;
            }
            io_prep(w, idx);
            return;
        }
        if (s->op.kind == NVT_OP_READ && e->sealed) {
            /* Opened next round, after the ring was refilled (as a hash). */
            nvt_read_done *r = &w->reads[w->n_reads++];
            r->op_id = s->op.op_id;
            r->data = s->stage ? s->stage : e->buf + s->op.buf_offset;
            r->dst = s->stage ? e->buf + s->op.buf_offset : NULL;
            r->stage_first = s->stage_first;
            r->stage_units = s->stage_units;
            r->length = e->seal.row_bytes;
            r->seed = s->op.seed;
            r->file_idx = (uint32_t)s->op.file_idx;
            r->file_off = (uint64_t)s->op.file_offset;
            r->sealed = 1;
            memcpy(r->trailer, s->stage ? s->stage + e->seal.row_bytes : s->trail, NVT_TRAILER_BYTES);
            /* The span stays with the read until it is opened (as above). */
            s->stage = NULL;
            w->inflight_bytes -= (uint64_t)s->op.length;
            w->free_slots[w->n_free++] = idx;
            return;
        }
        if (s->op.kind == NVT_OP_READ && s->op.checksum) {
            /* Hashed next round, after the ring was refilled; the slot is free
             * now (the caller owns the buffer range until the completion). */
            nvt_read_done *r = &w->reads[w->n_reads++];
            r->op_id = s->op.op_id;
            r->data = s->stage ? s->stage : w->e->buf + s->op.buf_offset;
            r->dst = s->stage ? w->e->buf + s->op.buf_offset : NULL;
            r->stage_first = s->stage_first;
            r->stage_units = s->stage_units;
            r->length = length;
            r->seed = s->op.seed;
            r->sealed = 0;
            /* A staged read keeps its span until it is copied out, but its
             * bytes leave the cap now, so the ring is refilled before the
             * copy; the arena holds twice the cap for that. */
            w->inflight_bytes -= length;
            s->stage = NULL;
            w->free_slots[w->n_free++] = idx;
            return;
        }
        io_finish(w, idx, (int64_t)s->op.length, s->checksum);
        return;
    }
    /* res == 0: end of file or no space, nothing moved. An error after some
     * bytes moved is a short transfer, which every engine reports as -EIO. */
    io_finish(w, idx, (res == 0 || s->moved > 0) ? -EIO : res, 0);
}

/* Hand a worker's reaped completions to waiters. Takes e->lock. The
 * completion hook (nvt_engine_set_apply: the slot table's side of each
 * completion, done here instead of on the thread that collects) sees them
 * first: every completion in `out` is unpublished, and io_publish publishes
 * all of them. */
static void io_publish(nvt_worker *w) {
    nvt_engine *e = w->e;
    if (!w->out.len)
        return;
    if (__atomic_load_n(&e->apply_on, __ATOMIC_ACQUIRE)) {
        pthread_rwlock_rdlock(&e->apply_lock);
        if (e->apply_fn)
            e->apply_fn(e->apply_ctx, w->out.items, w->out.len);
        pthread_rwlock_unlock(&e->apply_lock);
    }
    pthread_mutex_lock(&e->lock);
    if (!e->done.len) {
        nvt_completion_batch t = e->done;
        e->done = w->out;
        w->out = t;
    } else {
        batch_reserve_hard(&e->done, w->out.len);
        memcpy(e->done.items + e->done.len, w->out.items, w->out.len * sizeof(*w->out.items));
        e->done.len += w->out.len;
    }
    done_changed_locked(e);
    w->out.len = 0;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
}

static uint64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* A failed ring submits nothing more (nor re-arms its wake read): the ops
 * whose SQEs the kernel never took (between its head and our tail) fail now
 * with -err, once; the kernel never takes them later, since every later
 * io_uring_enter of this thread submits nothing (io_uring_get_events). */
static void io_fail_unsubmitted(nvt_worker *w, int err) {
    if (w->sq_abandoned)
        return;
    w->sq_abandoned = 1;
    struct io_uring_sq *sq = &w->ring.sq;
    unsigned head = __atomic_load_n(sq->khead, __ATOMIC_ACQUIRE);
    for (unsigned i = head; i != sq->sqe_tail; i++) {
        uint64_t tag = sq->sqes[i & sq->ring_mask].user_data;
        if (tag == NVT_WAKE_TAG)
            w->wake_armed = 0;
        else
            io_finish(w, (unsigned)tag, -err, 0);
    }
    sq->sqe_head = sq->sqe_tail;
}

/* A failed ring past NVT_STOP_GRACE_MS of close: every op still in a slot
 * (taken by the kernel, never reaped) fails with -err. */
static void io_fail_slots(nvt_worker *w, int err) {
    char *busy = calloc(w->qd, 1);
    if (!busy)
        return; /* keep waiting: the next round tries again */
    for (unsigned i = 0; i < w->n_free; i++)
        busy[w->free_slots[i]] = 1; /* free, in fact */
    for (unsigned i = 0; i < w->qd; i++)
        if (!busy[i])
            io_finish(w, i, -err, 0);
    free(busy);
}

static void io_run(nvt_worker *w) {
    nvt_engine *e = w->e;
    unsigned qd = w->qd;

    io_arm_wake(w);
    for (;;) {
        unsigned n_taken = 0, n_seal = 0;
        int stop, failed, more = 0;

        nvt_engine_relay_wakes(e);
        io_publish(w);
        pthread_mutex_lock(&w->lock);
        failed = w->failed;
        while (w->pend_len && (w->n_free || failed)) {
            nvt_op *op = &w->pend[w->pend_head];
            if (failed) {
                /* The ring failed: the op fails without I/O. */
                batch_reserve_hard(&w->out, 1);
                batch_push(&w->out, op->op_id, -failed, 0);
                io_count(w, -failed);
            } else {
                /* Sealing: a few writes a round, so the ring is reaped and
                 * completions published between seals (each ~0.5 ms). */
                if (e->sealed && op->kind == NVT_OP_WRITE && n_seal++ >= NVT_SEAL_BATCH) {
                    more = 1;
                    break;
                }
                /* One op larger than the cap still runs, alone. */
                if (w->inflight_bytes && w->inflight_bytes + (uint64_t)op->length > w->max_inflight_bytes)
                    break;
                unsigned idx = w->free_slots[--w->n_free];
                w->slots[idx].op = *op;
                w->slots[idx].moved = 0;
                w->slots[idx].checksum = 0;
                w->inflight_bytes += (uint64_t)op->length;
                w->taken[n_taken++] = idx;
            }
            w->pend_head = (w->pend_head + 1) & (w->pend_cap - 1);
            w->pend_len--;
        }
        stop = w->closing;
        /* While ops are in flight (or still pending) a completion wakes us
         * soon and we take new ops then, so a submitter need not pay for a
         * wake-up (an eventfd write that costs vLLM's thread several us).
         * Only an idle worker, with nothing in flight, needs the eventfd. */
        w->sleeping = !stop && !failed && w->pend_len == 0 && w->n_free == qd;
        pthread_mutex_unlock(&w->lock);
        if (failed)
            io_publish(w);

        uint64_t hashed = 0;
        int refused = 0; /* ops failed before their SQE (sealing) */
        for (unsigned i = 0; i < n_taken; i++) {
            nvt_slot *s = &w->slots[w->taken[i]];
            nvt_stage_take(w, s, e->sealed ? e->seal.slot_bytes : (uint64_t)s->op.length);
            if (s->stage && s->op.kind == NVT_OP_WRITE && !s->op.checksum && !e->sealed)
                nvt_copy(s->stage, e->buf + s->op.buf_offset, (size_t)s->op.length);
            if (e->sealed) {
                /* Sealed here, on this worker, before the SQE (the key
                 * table's read lock is the only one shared with others). */
                int err = s->op.kind == NVT_OP_WRITE ? nvt_seal_write(e, s)
                          : s->stage                 ? 0
                                                     : nvt_seal_read_ready(e, s);
                if (err) {
                    io_finish(w, w->taken[i], err, 0);
                    refused = 1;
                    continue;
                }
                if (s->op.kind == NVT_OP_WRITE) {
                    hashed += (uint64_t)s->op.length;
                    __atomic_fetch_add(&w->n_hashed, (uint64_t)s->op.length, __ATOMIC_RELAXED);
                    if (hashed >= NVT_SUBMIT_EVERY_BYTES && i + 1 < n_taken) {
                        io_submit(w);
                        hashed = 0;
                    }
                }
            } else if (s->op.kind == NVT_OP_WRITE && s->op.checksum) {
                /* Staged: hash the copy, in the same pass as the copy, so the
                 * bytes written are the bytes hashed even if the caller
                 * touches its row meanwhile. */
                s->checksum = s->stage ? nvt_xxh3_copy(s->stage, e->buf + s->op.buf_offset,
                                                       (size_t)s->op.length, s->op.seed)
                                       : nvt_xxh3(e->buf + s->op.buf_offset, (size_t)s->op.length,
                                                  s->op.seed);
                hashed += (uint64_t)s->op.length;
                __atomic_fetch_add(&w->n_hashed, (uint64_t)s->op.length, __ATOMIC_RELAXED);
                if (hashed >= NVT_SUBMIT_EVERY_BYTES && i + 1 < n_taken) {
                    io_submit(w);
                    hashed = 0;
                }
            }
            io_prep(w, w->taken[i]);
        }
        if (refused) {
            /* Their completions must not wait for another op's CQE (there
             * may be none): round again, which publishes them first and
             * recomputes `sleeping` (the SQEs prepped are submitted then). */
            continue;
        }

        if (w->n_reads) {
            if (!failed && io_uring_sq_ready(&w->ring))
                io_submit(w);
            batch_reserve_hard(&w->out, w->n_reads);
            for (unsigned i = 0; i < w->n_reads; i++) {
                nvt_read_done *r = &w->reads[i];
                /* This thread may be the idle worker a submit woke to wake
                 * the others (it said `sleeping` with reads left to hash or
                 * open): relay before each one, so their ops wait for one
                 * hash or open at most, not for the whole backlog. */
                nvt_engine_relay_wakes(e);
                if (r->sealed) {
                    uint64_t sum;
                    int64_t res = nvt_seal_open(e, r, &sum);
                    if (r->dst)
                        nvt_stage_give(w, r->stage_first, r->stage_units);
                    batch_reserve_hard(&w->out, 1); /* io_publish may have swapped it */
                    batch_push(&w->out, r->op_id, res, sum);
                    io_count(w, res);
                    io_publish(w); /* each opened chunk at once (~0.5 ms each) */
                } else {
                    uint64_t sum;
                    if (r->dst) {
                        /* Copy out and hash the copy in one pass: the checksum
                         * covers the bytes the caller gets. The span and its
                         * bytes in flight are given back only now. */
                        sum = nvt_xxh3_copy(r->dst, r->data, (size_t)r->length, r->seed);
                        nvt_stage_give(w, r->stage_first, r->stage_units);
                    } else {
                        sum = nvt_xxh3(r->data, r->length, r->seed);
                    }
                    batch_push(&w->out, r->op_id, (int64_t)r->length, sum);
                    io_count(w, (int64_t)r->length);
                }
                __atomic_fetch_add(&w->n_hashed, r->length, __ATOMIC_RELAXED);
            }
            w->n_reads = 0;
            io_publish(w);
        }

        if (failed) {
            /* Nothing more is submitted: what the kernel never took fails
             * now, what it took is reaped as it completes (polled: no wake
             * read). Closing, that wait is bounded. */
            io_fail_unsubmitted(w, failed);
            if (stop && w->n_free != qd) {
                uint64_t now = mono_ms();
                if (!w->stop_ms)
                    w->stop_ms = now;
                else if (now - w->stop_ms >= NVT_STOP_GRACE_MS)
                    io_fail_slots(w, failed);
            }
            io_publish(w);
        }

        if (stop && w->n_free == qd)
            break; /* closing, and nothing left in the ring */

        /* Nothing blocks with a relay it could do now (one atomic load). */
        nvt_engine_relay_wakes(e);
        int inj = __atomic_load_n(&w->inject_enter_err, __ATOMIC_RELAXED);
        int ret;
        if (failed) {
            ret = inj ? -inj : io_uring_get_events(&w->ring);
            usleep(1000);
        } else {
            /* Ops left in the queue for the next round: submit, reap what
             * has completed, and come back without waiting. `in_wait`: a
             * submit prefers an idle worker in its wait as the one it wakes
             * (it relays at once; one still hashing would first finish the
             * read in hand). A hint only, read without the lock. */
            __atomic_store_n(&w->in_wait, 1, __ATOMIC_RELAXED);
            ret = inj ? -inj : io_uring_submit_and_wait(&w->ring, more ? 0 : 1);
            __atomic_store_n(&w->in_wait, 0, __ATOMIC_RELAXED);
        }
        if (failed) {
            /* already failed: its errors change nothing */
        } else if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME) {
            /* Not expected with a ring this thread sized itself; back off
             * rather than spin, and keep reaping what completes. A ring that
             * keeps failing fails its ops from now on (only its own). */
            if (++w->enter_errors >= NVT_RING_FAIL_TRIES && !w->failed)
                nvt_engine_fail_worker(e, w->idx, -ret);
            usleep(1000);
        } else if (ret < 0) {
            /* Transient, unless it keeps coming with nothing completing
             * (counted down below when a completion is reaped). */
            if (++w->enter_stalls >= NVT_RING_TRANSIENT_TRIES && !w->failed)
                nvt_engine_fail_worker(e, w->idx, -ret);
            else if (w->enter_stalls > 1)
                usleep(1000);
        } else {
            w->enter_errors = 0;
            w->enter_stalls = 0;
        }

        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&w->ring, head, cqe) {
            uint64_t tag = io_uring_cqe_get_data64(cqe);
            seen++;
            if (tag == NVT_WAKE_TAG)
                w->wake_armed = 0;
            else
                io_on_cqe(w, (unsigned)tag, cqe->res);
        }
        io_uring_cq_advance(&w->ring, seen);
        if (seen)
            w->enter_stalls = 0; /* progress: the errors were transient */
        if (!w->wake_armed && !stop && !failed)
            io_arm_wake(w);
    }
}

void *nvt_io_main(void *arg) {
    nvt_worker *w = arg;
    nvt_engine *e = w->e;
    char name[16];
    snprintf(name, sizeof(name), "nvt-uring-%u", w->idx);
    pthread_setname_np(pthread_self(), name);
    int err = nvt_io_setup(w);

    pthread_mutex_lock(&e->lock);
    e->setup_done = err ? err : 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    if (err)
        return NULL;
    /* An open that fails after this worker started stops it through `closing`. */
    io_run(w);
    /* Exiting the ring cancels the wake read and unregisters buffers/files. */
    nvt_ring_destroy(&w->ring, &w->ring_fd_fork);

    io_publish(w);
    pthread_mutex_lock(&e->lock);
    e->n_exited++;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    return NULL;
}
