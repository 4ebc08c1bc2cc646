/* vsan_example: the vsan C API from end to end.
 *
 *   vsan_example <node.toml> <disk> [seed]
 *
 * Opens a node from a vsan-node configuration file, opens one of its disks, waits until
 * the mirror is connected and in sync (for a mirrored disk), and then:
 *
 *   1. writes [0, 64 KiB) with two blocking writes (the second with VSAN_IO_FUA),
 *      reads it back and compares, and flushes;
 *   2. writes [64 KiB, 320 KiB) as 64 asynchronous 4 KiB writes all in flight at once,
 *      waits for them, reads the range back with 64 asynchronous reads in flight at
 *      once and checks every byte, then submits an asynchronous flush;
 *   3. prints the disk's status, closes the disk and the node.
 *
 * The data is a pure function of the disk offset and the seed (see pattern_byte), so a
 * test can check the other replica of a mirror holds exactly what this program wrote.
 * It prints one result line per step and "vsan_example: OK" at the end; on any error it
 * prints the call, vsan_result_str() and vsan_last_error_message(), and exits 1.
 *
 * Build: cargo build --release -p vsan-ffi && make -C examples/c (see the Makefile).
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <vsan.h>

/* The layout this program writes (bytes from the start of the disk). */
#define SYNC_LEN (64u * 1024u)     /* [0, SYNC_LEN): blocking writes */
#define ASYNC_COUNT 64u            /* asynchronous I/Os in flight at once */
#define ASYNC_LEN 4096u            /* bytes per asynchronous I/O */
#define ASYNC_START SYNC_LEN       /* [ASYNC_START, TOTAL_LEN): asynchronous writes */
#define TOTAL_LEN (ASYNC_START + ASYNC_COUNT * ASYNC_LEN)

#define DEFAULT_SEED 0x5eedu
#define SYNC_TIMEOUT_MS 60000u     /* how long to wait for the mirror to be in sync */
#define ASYNC_TIMEOUT_S 120        /* how long to wait for a batch of callbacks */

/* The byte at disk offset `offset`: one 64-bit mixed word per 8 bytes of the disk,
 * stored little-endian. The Rust test computes the same function. */
static uint8_t pattern_byte(uint64_t offset, uint64_t seed) {
    uint64_t x = (offset / 8) * UINT64_C(0x9E3779B97F4A7C15) ^ seed;
    x ^= x >> 29;
    x *= UINT64_C(0xBF58476D1CE4E5B9);
    x ^= x >> 32;
    return (uint8_t)(x >> (8 * (offset % 8)));
}

static void fill_pattern(uint8_t *buf, uint64_t offset, size_t len, uint64_t seed) {
    for (size_t i = 0; i < len; i++) {
        buf[i] = pattern_byte(offset + i, seed);
    }
}

/* The first offset in `buf` (holding disk bytes from `offset`) that differs from the
 * pattern, or -1 when every byte matches. */
static int64_t check_pattern(const uint8_t *buf, uint64_t offset, size_t len, uint64_t seed) {
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != pattern_byte(offset + i, seed)) {
            return (int64_t)(offset + i);
        }
    }
    return -1;
}

/* The calling thread's last error message, in a malloc'd string (or NULL). */
static char *last_error(void) {
    size_t len = 0;
    char probe[256];
    vsan_result r = vsan_last_error_message(probe, sizeof probe, &len);
    if (r == VSAN_OK) {
        return strdup(probe);
    }
    if (r != VSAN_ERR_BUFFER_TOO_SMALL) {
        return NULL;
    }
    /* Too long for the probe: the call told us its length. */
    char *buf = malloc(len + 1);
    if (buf != NULL && vsan_last_error_message(buf, len + 1, NULL) != VSAN_OK) {
        free(buf);
        buf = NULL;
    }
    return buf;
}

/* Print a failed call: its name, the code's text and this thread's detail. */
static void report(const char *what, vsan_result r) {
    char *detail = last_error();
    fprintf(stderr, "vsan_example: %s failed: %s (%d): %s\n", what, vsan_result_str(r),
            (int)r, detail != NULL ? detail : "(no detail)");
    free(detail);
}

static const char *link_name(uint32_t link) {
    switch (link) {
    case VSAN_LINK_LOCAL: return "local";
    case VSAN_LINK_WAITING: return "waiting";
    case VSAN_LINK_HANDSHAKING: return "handshaking";
    case VSAN_LINK_CONNECTED: return "connected";
    case VSAN_LINK_DEGRADED: return "degraded";
    default: return "unknown";
    }
}

static void print_status(const char *when, const vsan_disk_status *st) {
    /* `transport` is NUL-terminated within its array by the library; print it bounded
     * all the same. */
    printf("status (%s): size=%" PRIu64 " block_size=%" PRIu32 " mirrored=%s link=%s "
           "peer=%" PRIu32 " transport=%.*s syncing=%s inconsistent=%s diverged=%s "
           "dirty_chunks=%" PRIu64 " generation=%#" PRIx64 " quorum=%" PRId32 "\n",
           when, st->size, st->block_size, st->mirrored ? "yes" : "no", link_name(st->link),
           st->peer_id, VSAN_TRANSPORT_LEN,
           st->transport[0] != '\0' ? st->transport : "-", st->syncing ? "yes" : "no",
           st->inconsistent ? "yes" : "no", st->diverged ? "yes" : "no", st->dirty_chunks,
           st->generation, st->quorum);
}

/* --- Asynchronous I/O: a batch of submissions and their completions ---------------- */

/* What the completion callback shares with the thread that waits. The callback may run
 * on the submitting thread before the submit call returns, or on one of the library's
 * threads, so everything is under `lock`. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t done_cv;
    unsigned accepted;        /* submissions the library accepted (set by the submitter) */
    unsigned completed;       /* callbacks that ran */
    unsigned failed;          /* callbacks with an error */
    uint64_t seen;            /* bit per tag: each callback runs exactly once */
    bool duplicate;           /* a tag came back twice, or out of range */
    vsan_result first_error;  /* the first error a callback got */
    char first_message[256];  /* and its detail */
} batch;

static int batch_init(batch *b) {
    memset(b, 0, sizeof *b);
    if (pthread_mutex_init(&b->lock, NULL) != 0) {
        return -1;
    }
    if (pthread_cond_init(&b->done_cv, NULL) != 0) {
        pthread_mutex_destroy(&b->lock);
        return -1;
    }
    return 0;
}

static void batch_destroy(batch *b) {
    pthread_cond_destroy(&b->done_cv);
    pthread_mutex_destroy(&b->lock);
}

/* Forget the last round's completions (no I/O of the batch may be in flight). */
static void batch_reset(batch *b) {
    pthread_mutex_lock(&b->lock);
    b->accepted = b->completed = b->failed = 0;
    b->seen = 0;
    b->duplicate = false;
    b->first_error = VSAN_OK;
    b->first_message[0] = '\0';
    pthread_mutex_unlock(&b->lock);
}

/* The completion callback (vsan_completion). It does not block: it only takes a lock
 * that nobody holds for long. Tags are 0..63 for the I/Os of a round. */
static void on_complete(void *userdata, vsan_result result, uint64_t tag) {
    batch *b = userdata;
    char message[sizeof b->first_message] = "";
    if (result != VSAN_OK) {
        /* The detail of a failed I/O is this thread's last error during the callback. */
        vsan_last_error_message(message, sizeof message, NULL);
    }
    pthread_mutex_lock(&b->lock);
    if (tag >= 64 || (b->seen & (UINT64_C(1) << tag)) != 0) {
        b->duplicate = true;
    } else {
        b->seen |= UINT64_C(1) << tag;
    }
    if (result != VSAN_OK) {
        if (b->failed == 0) {
            b->first_error = result;
            memcpy(b->first_message, message, sizeof message);
        }
        b->failed++;
    }
    b->completed++;
    pthread_cond_broadcast(&b->done_cv);
    pthread_mutex_unlock(&b->lock);
}

/* Note one more accepted submission. */
static void batch_accepted(batch *b) {
    pthread_mutex_lock(&b->lock);
    b->accepted++;
    pthread_mutex_unlock(&b->lock);
}

/* Wait until every accepted submission has called back (or the time limit passes).
 * Returns 0 when all completed without error. */
static int batch_wait(batch *b, const char *what) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += ASYNC_TIMEOUT_S;
    int rc = 0;
    pthread_mutex_lock(&b->lock);
    while (b->completed < b->accepted && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&b->done_cv, &b->lock, &deadline);
    }
    int status = 0;
    if (b->completed < b->accepted) {
        fprintf(stderr, "vsan_example: %s: only %u of %u completions after %d s\n", what,
                b->completed, b->accepted, ASYNC_TIMEOUT_S);
        status = -1;
    } else if (b->duplicate) {
        fprintf(stderr, "vsan_example: %s: a tag completed twice or was never submitted\n",
                what);
        status = -1;
    } else if (b->failed > 0) {
        fprintf(stderr, "vsan_example: %s: %u I/Os failed; the first: %s (%d): %s\n", what,
                b->failed, vsan_result_str(b->first_error), (int)b->first_error,
                b->first_message);
        status = -1;
    }
    pthread_mutex_unlock(&b->lock);
    return status;
}

/* --- The program ------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s <node.toml> <disk> [seed]\n", argv[0]);
        return 2;
    }
    const char *config = argv[1];
    const char *disk_name = argv[2];
    uint64_t seed = DEFAULT_SEED;
    if (argc == 4) {
        char *end = NULL;
        errno = 0;
        seed = strtoull(argv[3], &end, 0);
        if (errno != 0 || end == argv[3] || *end != '\0') {
            fprintf(stderr, "vsan_example: seed %s is not a number\n", argv[3]);
            return 2;
        }
    }

    int status = 1;          /* the exit status, 0 once everything passed */
    vsan_node *node = NULL;
    vsan_disk *disk = NULL;
    uint8_t *sync_buf = NULL, *sync_back = NULL;
    uint8_t *async_out = NULL, *async_in = NULL;
    bool batch_ready = false;
    batch b;
    vsan_result r;

    printf("vsan library %s (header %d.%d.%d)\n", vsan_version(), VSAN_VERSION_MAJOR,
           VSAN_VERSION_MINOR, VSAN_VERSION_PATCH);

    /* Everything that may still be written by a callback lives until the node is closed
     * (vsan_node_free waits for I/Os in flight), so it is allocated up front and freed at
     * the end, after the node. */
    sync_buf = malloc(SYNC_LEN);
    sync_back = malloc(SYNC_LEN);
    async_out = malloc((size_t)ASYNC_COUNT * ASYNC_LEN);
    async_in = malloc((size_t)ASYNC_COUNT * ASYNC_LEN);
    if (sync_buf == NULL || sync_back == NULL || async_out == NULL || async_in == NULL) {
        fprintf(stderr, "vsan_example: out of memory\n");
        goto out;
    }
    if (batch_init(&b) != 0) {
        fprintf(stderr, "vsan_example: cannot initialise a mutex or condition variable\n");
        goto out;
    }
    batch_ready = true;

    /* Open the node: its disks, its mirrors (dialing or awaiting the peer), its NBD
     * exports. */
    r = vsan_node_new_from_file(config, &node);
    if (r != VSAN_OK) {
        report("vsan_node_new_from_file", r);
        goto out;
    }
    r = vsan_disk_open(node, disk_name, &disk);
    if (r != VSAN_OK) {
        report("vsan_disk_open", r);
        goto out;
    }

    vsan_geometry geo;
    r = vsan_disk_geometry(disk, &geo);
    if (r != VSAN_OK) {
        report("vsan_disk_geometry", r);
        goto out;
    }
    printf("disk %s: size=%" PRIu64 " block_size=%" PRIu32 " max_io=%" PRIu32 "\n", disk_name,
           geo.size, geo.block_size, geo.max_io);
    if (geo.size < TOTAL_LEN || ASYNC_LEN % geo.block_size != 0 ||
        geo.max_io < SYNC_LEN / 2) {
        fprintf(stderr,
                "vsan_example: the disk must be at least %u bytes, with a block size dividing "
                "%u and max_io of at least %u\n",
                TOTAL_LEN, ASYNC_LEN, SYNC_LEN / 2);
        goto out;
    }

    vsan_disk_status st;
    r = vsan_disk_get_status(disk, &st);
    if (r != VSAN_OK) {
        report("vsan_disk_get_status", r);
        goto out;
    }
    print_status("opened", &st);

    /* A mirrored disk accepts I/O at once (degraded while the peer is away); waiting for
     * the mirror makes every write below go to both replicas. */
    if (st.mirrored) {
        r = vsan_disk_wait_synced(disk, SYNC_TIMEOUT_MS);
        if (r != VSAN_OK) {
            report("vsan_disk_wait_synced", r);
            goto out;
        }
        r = vsan_disk_get_status(disk, &st);
        if (r != VSAN_OK) {
            report("vsan_disk_get_status", r);
            goto out;
        }
        printf("mirror: connected and in sync with node %" PRIu32 " over %s\n", st.peer_id,
               st.transport);
    }
    printf("pattern: seed=%#" PRIx64 " bytes=[0,%u)\n", seed, TOTAL_LEN);

    /* 1. Blocking I/O: two writes (the second durable at once with FUA), one read. */
    fill_pattern(sync_buf, 0, SYNC_LEN, seed);
    r = vsan_disk_write(disk, 0, sync_buf, SYNC_LEN / 2, 0);
    if (r != VSAN_OK) {
        report("vsan_disk_write", r);
        goto out;
    }
    r = vsan_disk_write(disk, SYNC_LEN / 2, sync_buf + SYNC_LEN / 2, SYNC_LEN / 2,
                        VSAN_IO_FUA);
    if (r != VSAN_OK) {
        report("vsan_disk_write (FUA)", r);
        goto out;
    }
    memset(sync_back, 0, SYNC_LEN);
    r = vsan_disk_read(disk, 0, sync_back, SYNC_LEN);
    if (r != VSAN_OK) {
        report("vsan_disk_read", r);
        goto out;
    }
    int64_t bad = check_pattern(sync_back, 0, SYNC_LEN, seed);
    if (bad >= 0) {
        fprintf(stderr, "vsan_example: read back wrong data at offset %" PRId64 "\n", bad);
        goto out;
    }
    printf("write+read: OK (%u bytes at 0, FUA on the second half)\n", SYNC_LEN);
    r = vsan_disk_flush(disk);
    if (r != VSAN_OK) {
        report("vsan_disk_flush", r);
        goto out;
    }
    printf("flush: OK\n");

    /* 2. Asynchronous I/O: 64 writes in flight, then 64 reads in flight. The write data
     * is copied during the submit call; a read buffer must stay untouched until its
     * callback. Tag i is the i-th 4 KiB block of the range. */
    fill_pattern(async_out, ASYNC_START, (size_t)ASYNC_COUNT * ASYNC_LEN, seed);
    batch_reset(&b);
    for (unsigned i = 0; i < ASYNC_COUNT; i++) {
        r = vsan_disk_submit_write(disk, ASYNC_START + (uint64_t)i * ASYNC_LEN,
                                   async_out + (size_t)i * ASYNC_LEN, ASYNC_LEN, 0,
                                   on_complete, &b, i);
        if (r != VSAN_OK) {
            report("vsan_disk_submit_write", r);
            break;
        }
        batch_accepted(&b);
    }
    if (batch_wait(&b, "asynchronous writes") != 0 || r != VSAN_OK) {
        goto out;
    }

    memset(async_in, 0, (size_t)ASYNC_COUNT * ASYNC_LEN);
    batch_reset(&b);
    for (unsigned i = 0; i < ASYNC_COUNT; i++) {
        r = vsan_disk_submit_read(disk, ASYNC_START + (uint64_t)i * ASYNC_LEN,
                                  async_in + (size_t)i * ASYNC_LEN, ASYNC_LEN, on_complete,
                                  &b, i);
        if (r != VSAN_OK) {
            report("vsan_disk_submit_read", r);
            break;
        }
        batch_accepted(&b);
    }
    if (batch_wait(&b, "asynchronous reads") != 0 || r != VSAN_OK) {
        goto out;
    }
    bad = check_pattern(async_in, ASYNC_START, (size_t)ASYNC_COUNT * ASYNC_LEN, seed);
    if (bad >= 0) {
        fprintf(stderr, "vsan_example: asynchronous read got wrong data at offset %" PRId64
                "\n", bad);
        goto out;
    }
    printf("async: %u writes, %u reads in flight: OK\n", ASYNC_COUNT, ASYNC_COUNT);

    batch_reset(&b);
    r = vsan_disk_submit_flush(disk, on_complete, &b, 0);
    if (r != VSAN_OK) {
        report("vsan_disk_submit_flush", r);
        goto out;
    }
    batch_accepted(&b);
    if (batch_wait(&b, "asynchronous flush") != 0) {
        goto out;
    }
    printf("async flush: OK\n");

    /* 3. Status, then close. */
    r = vsan_disk_get_status(disk, &st);
    if (r != VSAN_OK) {
        report("vsan_disk_get_status", r);
        goto out;
    }
    print_status("done", &st);
    if (st.mirrored && st.link != VSAN_LINK_CONNECTED) {
        fprintf(stderr, "vsan_example: the mirror is %s after the I/O, not connected\n",
                link_name(st.link));
        goto out;
    }
    status = 0;

out:
    /* Close the disk handle, then the node: it waits for I/Os still in flight (their
     * callbacks run), flushes, and marks the mirror's metadata clean. */
    if (disk != NULL) {
        r = vsan_disk_free(disk);
        if (r != VSAN_OK) {
            report("vsan_disk_free", r);
            status = 1;
        }
    }
    if (node != NULL) {
        r = vsan_node_free(node);
        if (r != VSAN_OK) {
            report("vsan_node_free", r);
            status = 1;
        } else {
            printf("node closed: OK\n");
        }
    }
    if (batch_ready) {
        batch_destroy(&b);
    }
    free(sync_buf);
    free(sync_back);
    free(async_out);
    free(async_in);
    if (status == 0) {
        printf("vsan_example: OK\n");
    } else {
        fprintf(stderr, "vsan_example: FAILED\n");
    }
    return status;
}
