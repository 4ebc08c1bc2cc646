/* bad_args: every way a C caller can get the vsan API wrong, and the code it must get.
 *
 *   bad_args [dir]
 *
 * Runs against a node with one RAM-backed disk, opened from a TOML string (no image
 * files); `dir` is its data_dir and where a few config files are written (default: a
 * fresh directory under /tmp, removed at the end). Checks, with the result codes
 * vsan.h documents:
 *   - vsan_result_str of every code and of unknown ones, vsan_version;
 *   - vsan_last_error_message's buffer rules (BUFFER_TOO_SMALL, out_len, NULL buffer),
 *     that it is per thread, and that reading it or a later success does not change it;
 *   - NULL handles, NULL and misaligned out pointers, NULL buffers with a length, NULL
 *     callbacks, bad and missing configs, an unknown disk name;
 *   - lengths and offsets: 0, misaligned, past the end, offset + len past 2^64, buf + len
 *     past the end of the address space, len past max_io, unknown flag bits;
 *   - made-up handles, a node handle passed as a disk and the reverse, use after close
 *     and double close of disks and nodes;
 *   - blocking calls from inside completion callbacks (VSAN_ERR_WRONG_THREAD), on the
 *     submitting thread and on the library's threads;
 *   - that a failed call leaves its outputs untouched and a refused submission never
 *     calls back.
 * Prints one line per check, then "bad_args: N checks, 0 failed" and "bad_args: OK";
 * exits 0 only when every check passed.
 *
 * Build: cargo build --release -p vsan-ffi && make -C examples/c (see the Makefile).
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <vsan.h>

#define DISK_SIZE (1024u * 1024u)
#define CALLBACK_TIMEOUT_S 60

/* --- Checks ------------------------------------------------------------------------ */

static unsigned checks, failures;

/* Record one check and print its line. */
static bool check(bool ok, const char *fmt, ...) {
    va_list ap;
    checks++;
    if (!ok) {
        failures++;
    }
    printf("%s %3u: ", ok ? "ok  " : "FAIL", checks);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    return ok;
}

/* This thread's last error message (static buffer; "" when none). */
static const char *last_message(void) {
    static char buf[1024];
    buf[0] = '\0';
    if (vsan_last_error_message(buf, sizeof buf, NULL) != VSAN_OK) {
        snprintf(buf, sizeof buf, "(message too long)");
    }
    return buf;
}

/* A call returned `want`. On a mismatch the line shows the library's message. */
static bool expect_code(const char *what, vsan_result got, vsan_result want) {
    if (got == want) {
        return check(true, "%s -> %s (%d)", what, vsan_result_str(got), (int)got);
    }
    return check(false, "%s -> %s (%d), want %s (%d); message: %s", what, vsan_result_str(got),
                 (int)got, vsan_result_str(want), (int)want, last_message());
}

#define EXPECT(call, want) expect_code(#call, (call), (want))

/* Fill `n` bytes with a sentinel, and check they still hold it. */
#define SENTINEL 0xA5
static void fill_sentinel(void *p, size_t n) { memset(p, SENTINEL, n); }
static bool holds_sentinel(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != SENTINEL) {
            return false;
        }
    }
    return true;
}

/* A pointer `offset` bytes into `base`, for deliberately misaligned out pointers. Such a
 * pointer is only passed to the library, which must refuse it without writing to it. */
static void *at(void *base, size_t offset) { return (unsigned char *)base + offset; }

/* Made-up handle values: never returned by the library. */
#define MADE_UP_DISK ((vsan_disk *)(uintptr_t)0x1234)
#define MADE_UP_NODE ((vsan_node *)(uintptr_t)0x1234)

/* --- Completion recording ------------------------------------------------------------ */

#define MAX_TAGS 64

/* What callbacks report: per tag, how often it completed and with which result. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    unsigned calls;
    unsigned times[MAX_TAGS];
    vsan_result result[MAX_TAGS];
    char message[MAX_TAGS][160];
} recorder;

static void recorder_init(recorder *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void recorder_destroy(recorder *r) {
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->lock);
}

static void record(void *userdata, vsan_result result, uint64_t tag) {
    recorder *r = userdata;
    char message[sizeof r->message[0]] = "";
    if (result != VSAN_OK) {
        vsan_last_error_message(message, sizeof message, NULL);
    }
    pthread_mutex_lock(&r->lock);
    if (tag < MAX_TAGS) {
        r->times[tag]++;
        r->result[tag] = result;
        memcpy(r->message[tag], message, sizeof message);
    }
    r->calls++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->lock);
}

/* Wait until `calls` callbacks ran in all (or the time limit passed). */
static bool recorder_wait(recorder *r, unsigned calls) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += CALLBACK_TIMEOUT_S;
    pthread_mutex_lock(&r->lock);
    int rc = 0;
    while (r->calls < calls && rc == 0) {
        rc = pthread_cond_timedwait(&r->cv, &r->lock, &deadline);
    }
    bool ok = r->calls >= calls;
    pthread_mutex_unlock(&r->lock);
    return ok;
}

static unsigned recorder_calls(recorder *r) {
    pthread_mutex_lock(&r->lock);
    unsigned n = r->calls;
    pthread_mutex_unlock(&r->lock);
    return n;
}

/* Tag `tag` never called back. */
static void expect_no_completion(recorder *r, uint64_t tag, const char *what) {
    pthread_mutex_lock(&r->lock);
    unsigned times = r->times[tag];
    pthread_mutex_unlock(&r->lock);
    check(times == 0, "%s (tag %u): no callback (it ran %u time(s))", what, (unsigned)tag,
          times);
}

/* Tag `tag` called back exactly once, with `want`. */
static void expect_completion(recorder *r, uint64_t tag, vsan_result want, const char *what) {
    pthread_mutex_lock(&r->lock);
    unsigned times = r->times[tag];
    vsan_result got = r->result[tag];
    char message[sizeof r->message[0]];
    memcpy(message, r->message[tag], sizeof message);
    pthread_mutex_unlock(&r->lock);
    check(times == 1 && got == want, "%s: callback ran %u time(s) with %s (%d), want once with %s",
          what, times, vsan_result_str(got), (int)got, vsan_result_str(want));
    if (want != VSAN_OK) {
        check(message[0] != '\0', "%s: the callback's thread has the detail: %s", what,
              message);
    }
}

/* --- Blocking calls from callbacks ---------------------------------------------------- */

#define CHAIN_DEPTH 8

/* Shared with the callbacks that try blocking calls. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    vsan_node *node;
    vsan_disk *disk;
    vsan_disk *extra;           /* a spare disk handle the callback closes */
    const char *toml;           /* a valid config */
    const char *config_file;    /* a valid config file */
    pthread_t main_thread;
    unsigned char buf[4096];    /* for the blocking calls (never reached) */
    unsigned char nested_buf[CHAIN_DEPTH][4096];
    /* Results the first callback saw. */
    bool first_done;
    bool first_inline;          /* it ran on the main thread */
    vsan_result read_r, write_r, flush_r, discard_r, zeroes_r, node_free_r, node_new_r,
        node_file_r, status_r, geometry_r, disk_free_r;
    vsan_node *node_new_out;    /* must stay untouched */
    char wrong_thread_message[256];
    /* The chain: each level's blocking call, its thread, and its own result. */
    unsigned chain_levels;
    vsan_result chain_flush[CHAIN_DEPTH];
    vsan_result chain_result[CHAIN_DEPTH];
    vsan_result chain_submit[CHAIN_DEPTH];
    bool chain_inline[CHAIN_DEPTH];
} callback_state;

/* Calls every blocking function (each must refuse), and the non-blocking ones (each
 * must work), from inside a completion callback. */
static void blocking_from_callback(void *userdata, vsan_result result, uint64_t tag) {
    callback_state *s = userdata;
    (void)result;
    (void)tag;
    vsan_geometry geo;
    vsan_disk_status st;
    vsan_result read_r = vsan_disk_read(s->disk, 0, s->buf, sizeof s->buf);
    char message[sizeof s->wrong_thread_message] = "";
    vsan_last_error_message(message, sizeof message, NULL);
    vsan_result write_r = vsan_disk_write(s->disk, 0, s->buf, sizeof s->buf, 0);
    vsan_result flush_r = vsan_disk_flush(s->disk);
    vsan_result discard_r = vsan_disk_discard(s->disk, 0, 4096, 0);
    vsan_result zeroes_r = vsan_disk_write_zeroes(s->disk, 0, 4096, 0);
    vsan_result node_free_r = vsan_node_free(s->node);
    vsan_node *out = (vsan_node *)(uintptr_t)0x5a5a;
    vsan_result node_new_r = vsan_node_new_from_toml(s->toml, &out);
    vsan_result node_file_r = vsan_node_new_from_file(s->config_file, &out);
    vsan_result status_r = vsan_disk_get_status(s->disk, &st);
    vsan_result geometry_r = vsan_disk_geometry(s->disk, &geo);
    vsan_result disk_free_r = vsan_disk_free(s->extra);
    pthread_mutex_lock(&s->lock);
    s->first_inline = pthread_equal(pthread_self(), s->main_thread);
    s->read_r = read_r;
    s->write_r = write_r;
    s->flush_r = flush_r;
    s->discard_r = discard_r;
    s->zeroes_r = zeroes_r;
    s->node_free_r = node_free_r;
    s->node_new_r = node_new_r;
    s->node_file_r = node_file_r;
    s->node_new_out = out;
    s->status_r = status_r;
    s->geometry_r = geometry_r;
    s->disk_free_r = disk_free_r;
    memcpy(s->wrong_thread_message, message, sizeof message);
    s->first_done = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->lock);
}

/* One level of a chain of reads, each submitted from the previous one's callback: inline
 * completions nest only a few levels deep, so the later levels run on library threads.
 * Each level tries a blocking flush. */
static void chain_level(void *userdata, vsan_result result, uint64_t level) {
    callback_state *s = userdata;
    vsan_result flush_r = vsan_disk_flush(s->disk);
    bool on_main = pthread_equal(pthread_self(), s->main_thread);
    vsan_result submit_r = VSAN_OK;
    if (level + 1 < CHAIN_DEPTH) {
        submit_r = vsan_disk_submit_read(s->disk, 4096 * (level + 1), s->nested_buf[level + 1],
                                         4096, chain_level, s, level + 1);
    }
    pthread_mutex_lock(&s->lock);
    s->chain_flush[level] = flush_r;
    s->chain_result[level] = result;
    s->chain_submit[level] = submit_r;
    s->chain_inline[level] = on_main;
    s->chain_levels++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->lock);
}

static bool wait_state(callback_state *s, bool (*done)(const callback_state *)) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += CALLBACK_TIMEOUT_S;
    pthread_mutex_lock(&s->lock);
    int rc = 0;
    while (!done(s) && rc == 0) {
        rc = pthread_cond_timedwait(&s->cv, &s->lock, &deadline);
    }
    bool ok = done(s);
    pthread_mutex_unlock(&s->lock);
    return ok;
}

static bool first_done(const callback_state *s) { return s->first_done; }

static bool chain_done(const callback_state *s) {
    /* A level whose submit failed ends the chain early. */
    for (unsigned i = 0; i < s->chain_levels; i++) {
        if (s->chain_submit[i] != VSAN_OK) {
            return true;
        }
    }
    return s->chain_levels >= CHAIN_DEPTH;
}

/* --- Another thread's last error ------------------------------------------------------ */

typedef struct {
    vsan_result r;
    size_t len;
    char buf[64];
} thread_message;

static void *read_message_on_a_new_thread(void *arg) {
    thread_message *m = arg;
    m->r = vsan_last_error_message(m->buf, sizeof m->buf, &m->len);
    return NULL;
}

/* --- The checks ---------------------------------------------------------------------- */

static void result_strings(void) {
    printf("== result codes and version\n");
    static const vsan_result known[] = {
        VSAN_OK, VSAN_ERR_INVALID_ARGUMENT, VSAN_ERR_OUT_OF_RANGE, VSAN_ERR_IO,
        VSAN_ERR_NOT_SUPPORTED, VSAN_ERR_READ_ONLY, VSAN_ERR_CLOSED, VSAN_ERR_TIMEOUT,
        VSAN_ERR_CORRUPT, VSAN_ERR_PROTOCOL, VSAN_ERR_IN_USE, VSAN_ERR_NOT_FOUND,
        VSAN_ERR_NO_SPACE, VSAN_ERR_NO_QUORUM, VSAN_ERR_WRONG_STATE, VSAN_ERR_NULL_POINTER,
        VSAN_ERR_OVERFLOW, VSAN_ERR_BAD_HANDLE, VSAN_ERR_PANIC, VSAN_ERR_BUFFER_TOO_SMALL,
        VSAN_ERR_MISALIGNED, VSAN_ERR_WRONG_THREAD,
    };
    const size_t n = sizeof known / sizeof known[0];
    /* The documented values: 0..14, then 64..70. */
    bool values = true;
    for (size_t i = 0; i < n; i++) {
        values = values && known[i] == (vsan_result)(i < 15 ? i : 64 + (i - 15));
    }
    check(values, "the codes are 0..14 and 64..70");
    for (size_t i = 0; i < n; i++) {
        const char *s = vsan_result_str(known[i]);
        check(s != NULL && s[0] != '\0' && strcmp(s, "unknown result code") != 0,
              "vsan_result_str(%d) = \"%s\"", (int)known[i], s != NULL ? s : "(NULL)");
    }
    bool distinct = true;
    for (size_t i = 0; i < n; i++) {
        for (size_t j = i + 1; j < n; j++) {
            distinct = distinct && strcmp(vsan_result_str(known[i]), vsan_result_str(known[j])) != 0;
        }
    }
    check(distinct, "every code has its own text");
    check(strcmp(vsan_result_str(VSAN_OK), "ok") == 0, "VSAN_OK is \"ok\"");
    check(strcmp(vsan_result_str(VSAN_ERR_INVALID_ARGUMENT), "invalid argument") == 0,
          "VSAN_ERR_INVALID_ARGUMENT is \"invalid argument\"");
    static const vsan_result unknown[] = {-1, 15, 63, 71, 1000, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *s = vsan_result_str(unknown[i]);
        check(s != NULL && strcmp(s, "unknown result code") == 0, "vsan_result_str(%" PRId32
              ") = \"%s\"", unknown[i], s != NULL ? s : "(NULL)");
    }
    const char *v = vsan_version();
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", VSAN_VERSION_MAJOR, VSAN_VERSION_MINOR,
             VSAN_VERSION_PATCH);
    check(v != NULL && strcmp(v, want) == 0, "vsan_version() = \"%s\", the header says %s",
          v != NULL ? v : "(NULL)", want);
}

static void last_error_rules(void) {
    printf("== vsan_last_error_message\n");
    char buf[256];
    size_t len = 777;
    memset(buf, 'x', sizeof buf);
    EXPECT(vsan_last_error_message(buf, sizeof buf, &len), VSAN_OK);
    check(len == 0 && buf[0] == '\0', "no failed call yet: an empty message (len %zu)", len);

    /* A failure to read about. */
    vsan_geometry geo;
    EXPECT(vsan_disk_geometry(NULL, &geo), VSAN_ERR_NULL_POINTER);
    char message[256];
    size_t n = 0;
    EXPECT(vsan_last_error_message(message, sizeof message, &n), VSAN_OK);
    check(n == strlen(message) && n > 0, "out_len %zu is the message's length: \"%s\"", n,
          message);
    check(strncmp(message, "vsan_disk_geometry", strlen("vsan_disk_geometry")) == 0,
          "the message names the call");

    len = 777;
    EXPECT(vsan_last_error_message(NULL, 0, &len), VSAN_ERR_BUFFER_TOO_SMALL);
    check(len == n, "NULL buffer, len 0: out_len %zu tells the length", len);
    len = 777;
    EXPECT(vsan_last_error_message(NULL, 5, &len), VSAN_ERR_NULL_POINTER);
    check(len == 777, "NULL buffer with a length: out_len untouched");
    memset(buf, 'x', sizeof buf);
    len = 777;
    EXPECT(vsan_last_error_message(buf, n, &len), VSAN_ERR_BUFFER_TOO_SMALL);
    bool untouched = true;
    for (size_t i = 0; i < sizeof buf; i++) {
        untouched = untouched && buf[i] == 'x';
    }
    check(untouched && len == n, "room for the text but not its NUL: buffer untouched, "
          "out_len %zu", len);
    EXPECT(vsan_last_error_message(buf, 1, NULL), VSAN_ERR_BUFFER_TOO_SMALL);
    len = 777;
    EXPECT(vsan_last_error_message(buf, n + 1, &len), VSAN_OK);
    check(len == n && strcmp(buf, message) == 0, "exactly enough room: the whole message");
    EXPECT(vsan_last_error_message(buf, sizeof buf, NULL), VSAN_OK);
    check(strcmp(buf, message) == 0, "reading it (and its own failures) leaves it alone");

    /* A later success keeps it; another thread has its own. */
    EXPECT(vsan_last_error_message(buf, sizeof buf, NULL), VSAN_OK);
    thread_message other = {.r = -1, .len = 777};
    memset(other.buf, 'x', sizeof other.buf);
    pthread_t t;
    if (check(pthread_create(&t, NULL, read_message_on_a_new_thread, &other) == 0,
              "start a thread")) {
        pthread_join(t, NULL);
        check(other.r == VSAN_OK && other.len == 0 && other.buf[0] == '\0',
              "a new thread has an empty message (result %d, len %zu)", (int)other.r,
              other.len);
    }
    EXPECT(vsan_last_error_message(buf, sizeof buf, NULL), VSAN_OK);
    check(strcmp(buf, message) == 0, "this thread's message is still its own");
}

/* The config of the node the checks run on: one RAM disk. */
static char *node_toml(const char *dir, const char *disk_name, unsigned size) {
    const char *fmt = "[node]\nid = 1\ndata_dir = '%s'\nthreads = 2\n\n"
                      "[[disk]]\nname = \"%s\"\nsize = %u\nbacking = \"mem\"\n";
    int len = snprintf(NULL, 0, fmt, dir, disk_name, size);
    char *s = malloc((size_t)len + 1);
    if (s != NULL) {
        snprintf(s, (size_t)len + 1, fmt, dir, disk_name, size);
    }
    return s;
}

static bool write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return false;
    }
    bool ok = fputs(text, f) >= 0;
    return fclose(f) == 0 && ok;
}

static void node_configs(const char *toml, const char *good_file, const char *bad_file,
                         const char *missing_file) {
    printf("== opening nodes\n");
    vsan_node *node = (vsan_node *)(uintptr_t)0x5a5a;
    const vsan_node *const untouched = node;
    EXPECT(vsan_node_new_from_toml(NULL, &node), VSAN_ERR_NULL_POINTER);
    check(node == untouched, "out untouched");
    EXPECT(vsan_node_new_from_toml(toml, NULL), VSAN_ERR_NULL_POINTER);
    _Alignas(vsan_node *) unsigned char raw[2 * sizeof(vsan_node *)];
    fill_sentinel(raw, sizeof raw);
    EXPECT(vsan_node_new_from_toml(toml, (vsan_node **)at(raw, 1)), VSAN_ERR_MISALIGNED);
    check(holds_sentinel(raw, sizeof raw), "misaligned out untouched");
    EXPECT(vsan_node_new_from_toml("this is [not toml", &node), VSAN_ERR_INVALID_ARGUMENT);
    check(node == untouched, "out untouched");
    EXPECT(vsan_node_new_from_toml("", &node), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_node_new_from_toml("\xff\xfe", &node), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_node_new_from_toml("[node]\nid = 1\ndata_dir = '/tmp'\n[[disk]]\nname = \"v\"\n"
                                   "size = \"lots\"\nbacking = \"mem\"\n", &node),
           VSAN_ERR_INVALID_ARGUMENT);
    check(strstr(last_message(), "disk[0].size") != NULL, "the message names the key: %s",
          last_message());
    EXPECT(vsan_node_new_from_toml("[node]\nid = 1\ndata_dir = '/tmp'\nbogus = 1\n", &node),
           VSAN_ERR_INVALID_ARGUMENT);
    check(strstr(last_message(), "bogus") != NULL, "the message names the key: %s",
          last_message());
    check(node == untouched, "out untouched");
    EXPECT(vsan_node_new_from_file(NULL, &node), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_node_new_from_file(good_file, NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_node_new_from_file(missing_file, &node), VSAN_ERR_NOT_FOUND);
    check(node == untouched, "out untouched");
    EXPECT(vsan_node_new_from_file(bad_file, &node), VSAN_ERR_INVALID_ARGUMENT);
    check(node == untouched, "out untouched");
    if (EXPECT(vsan_node_new_from_file(good_file, &node), VSAN_OK)) {
        check(node != NULL && node != untouched, "a node from a good file");
        EXPECT(vsan_node_free(node), VSAN_OK);
    }
}

static void disk_opening(vsan_node *node, vsan_disk *disk) {
    printf("== opening disks\n");
    vsan_disk *out = (vsan_disk *)(uintptr_t)0x5a5a;
    const vsan_disk *const untouched = out;
    EXPECT(vsan_disk_open(NULL, "vol0", &out), VSAN_ERR_NULL_POINTER);
    check(out == untouched, "out untouched");
    EXPECT(vsan_disk_open(MADE_UP_NODE, "vol0", &out), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_open((vsan_node *)disk, "vol0", &out), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_open(node, NULL, &out), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_open(node, "vol0", NULL), VSAN_ERR_NULL_POINTER);
    _Alignas(vsan_disk *) unsigned char raw[2 * sizeof(vsan_disk *)];
    fill_sentinel(raw, sizeof raw);
    EXPECT(vsan_disk_open(node, "vol0", (vsan_disk **)at(raw, 3)), VSAN_ERR_MISALIGNED);
    check(holds_sentinel(raw, sizeof raw), "misaligned out untouched");
    EXPECT(vsan_disk_open(node, "no-such-disk", &out), VSAN_ERR_NOT_FOUND);
    EXPECT(vsan_disk_open(node, "\xff", &out), VSAN_ERR_INVALID_ARGUMENT);
    check(out == untouched, "out untouched");
    vsan_disk *second = NULL;
    if (EXPECT(vsan_disk_open(node, "vol0", &second), VSAN_OK)) {
        check(second != NULL && second != disk, "a second handle of the same disk");
        EXPECT(vsan_disk_free(second), VSAN_OK);
        vsan_geometry geo;
        EXPECT(vsan_disk_geometry(disk, &geo), VSAN_OK);
    }
}

static void geometry_and_status(vsan_node *node, vsan_disk *disk) {
    printf("== geometry and status\n");
    vsan_geometry geo;
    fill_sentinel(&geo, sizeof geo);
    EXPECT(vsan_disk_geometry(NULL, &geo), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_geometry(disk, NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_geometry(MADE_UP_DISK, &geo), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_geometry((vsan_disk *)(uintptr_t)UINTPTR_MAX, &geo), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_geometry((vsan_disk *)(void *)&geo, &geo), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_geometry((vsan_disk *)node, &geo), VSAN_ERR_BAD_HANDLE);
    check(holds_sentinel(&geo, sizeof geo), "geometry untouched by the failed calls");
    _Alignas(vsan_geometry) unsigned char raw[sizeof(vsan_geometry) + 16];
    fill_sentinel(raw, sizeof raw);
    EXPECT(vsan_disk_geometry(disk, (vsan_geometry *)at(raw, 1)), VSAN_ERR_MISALIGNED);
    EXPECT(vsan_disk_geometry(disk, (vsan_geometry *)at(raw, 4)), VSAN_ERR_MISALIGNED);
    check(holds_sentinel(raw, sizeof raw), "misaligned out untouched");
    /* The failure message survives a later success. */
    char before[512];
    snprintf(before, sizeof before, "%s", last_message());
    if (EXPECT(vsan_disk_geometry(disk, &geo), VSAN_OK)) {
        check(geo.size == DISK_SIZE && geo.block_size == 512 && geo.max_io >= 512,
              "size %" PRIu64 ", block size %" PRIu32 ", max_io %" PRIu32, geo.size,
              geo.block_size, geo.max_io);
    }
    check(strcmp(before, last_message()) == 0, "a success leaves the last message alone");

    vsan_disk_status st;
    fill_sentinel(&st, sizeof st);
    EXPECT(vsan_disk_get_status(NULL, &st), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_get_status(disk, NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_get_status(MADE_UP_DISK, &st), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_get_status((vsan_disk *)node, &st), VSAN_ERR_BAD_HANDLE);
    check(holds_sentinel(&st, sizeof st), "status untouched by the failed calls");
    _Alignas(vsan_disk_status) unsigned char raw_status[sizeof(vsan_disk_status) + 16];
    fill_sentinel(raw_status, sizeof raw_status);
    EXPECT(vsan_disk_get_status(disk, (vsan_disk_status *)at(raw_status, 2)), VSAN_ERR_MISALIGNED);
    check(holds_sentinel(raw_status, sizeof raw_status), "misaligned out untouched");
    if (EXPECT(vsan_disk_get_status(disk, &st), VSAN_OK)) {
        check(!st.mirrored && !st.cached && st.link == VSAN_LINK_LOCAL && st.quorum == -1 &&
                  st.transport[0] == '\0' && st.size == DISK_SIZE,
              "a local RAM disk: not mirrored, no cache, link local, no transport");
    }
    EXPECT(vsan_disk_wait_synced(disk, 10), VSAN_ERR_NOT_SUPPORTED);
    EXPECT(vsan_disk_wait_synced(NULL, 10), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_verify(disk), VSAN_ERR_NOT_SUPPORTED);
    EXPECT(vsan_disk_verify(MADE_UP_DISK), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_discard_my_data(disk), VSAN_ERR_NOT_SUPPORTED);
    EXPECT(vsan_disk_discard_my_data(NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_set_cache_mode(disk, VSAN_CACHE_WRITE_THROUGH), VSAN_ERR_NOT_SUPPORTED);
    EXPECT(vsan_disk_set_cache_mode(NULL, VSAN_CACHE_WRITE_THROUGH), VSAN_ERR_NULL_POINTER);
}

static void blocking_io(vsan_disk *disk) {
    printf("== blocking I/O\n");
    unsigned char *buf = calloc(1, 8192);
    unsigned char *back = calloc(1, 8192);
    vsan_geometry geo = {0};
    if (!check(buf != NULL && back != NULL, "buffers") ||
        !EXPECT(vsan_disk_geometry(disk, &geo), VSAN_OK)) {
        free(buf);
        free(back);
        return;
    }
    /* An address 1 KiB below the top of the address space: buf + 4096 wraps. */
    void *wrap = (void *)(UINTPTR_MAX - 1023);
    const uint64_t size = geo.size;

    EXPECT(vsan_disk_read(NULL, 0, buf, 4096), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_read(MADE_UP_DISK, 0, buf, 4096), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_read(disk, 0, NULL, 4096), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_read(disk, 0, buf, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_read(disk, 0, NULL, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_read(disk, 1, buf, 4096), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_read(disk, 0, buf, 100), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_read(disk, size, buf, 512), VSAN_ERR_OUT_OF_RANGE);
    EXPECT(vsan_disk_read(disk, size - 512, buf, 1024), VSAN_ERR_OUT_OF_RANGE);
    EXPECT(vsan_disk_read(disk, UINT64_MAX - 511, buf, 4096), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_read(disk, 0, wrap, 4096), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_read(disk, 0, buf, SIZE_MAX), VSAN_ERR_OVERFLOW);

    EXPECT(vsan_disk_write(NULL, 0, buf, 4096, 0), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_write((vsan_disk *)(uintptr_t)UINTPTR_MAX, 0, buf, 4096, 0),
           VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_write(disk, 0, NULL, 4096, 0), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_write(disk, 0, buf, 0, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write(disk, 512 + 1, buf, 512, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write(disk, 0, buf, 4095, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write(disk, size, buf, 512, 0), VSAN_ERR_OUT_OF_RANGE);
    EXPECT(vsan_disk_write(disk, size - 512, buf, 4096, 0), VSAN_ERR_OUT_OF_RANGE);
    EXPECT(vsan_disk_write(disk, UINT64_MAX - 511, buf, 4096, 0), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_write(disk, 0, wrap, 4096, 0), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_write(disk, 0, buf, SIZE_MAX, 0), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_write(disk, 0, buf, 4096, 2), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write(disk, 0, buf, 4096, 0x80000000u), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write(disk, 0, buf, 4096, UINT32_MAX), VSAN_ERR_INVALID_ARGUMENT);

    /* Longer than max_io (with a real buffer of that size: the length is legal for the
     * buffer, only too long for one request). */
    size_t big = (size_t)geo.max_io + geo.block_size;
    unsigned char *large = calloc(1, big);
    if (check(large != NULL, "a buffer of max_io + one block (%zu bytes)", big)) {
        EXPECT(vsan_disk_read(disk, 0, large, big), VSAN_ERR_INVALID_ARGUMENT);
        EXPECT(vsan_disk_write(disk, 0, large, big, 0), VSAN_ERR_INVALID_ARGUMENT);
        free(large);
    }

    /* None of the refused writes wrote: the disk still reads as zeros. */
    EXPECT(vsan_disk_read(disk, 0, back, 8192), VSAN_OK);
    bool zeros = true;
    for (size_t i = 0; i < 8192; i++) {
        zeros = zeros && back[i] == 0;
    }
    check(zeros, "the refused writes left no trace");

    for (size_t i = 0; i < 8192; i++) {
        buf[i] = (unsigned char)(i * 7 + 3);
    }
    EXPECT(vsan_disk_write(disk, 0, buf, 8192, VSAN_IO_FUA), VSAN_OK);
    EXPECT(vsan_disk_read(disk, 0, back, 8192), VSAN_OK);
    check(memcmp(buf, back, 8192) == 0, "what was written reads back");
    /* Buffers need no alignment. */
    EXPECT(vsan_disk_read(disk, 512, back + 1, 512), VSAN_OK);
    check(memcmp(buf + 512, back + 1, 512) == 0, "an unaligned buffer reads the same");

    EXPECT(vsan_disk_flush(NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_flush(MADE_UP_DISK), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_flush(disk), VSAN_OK);

    EXPECT(vsan_disk_discard(NULL, 0, 4096, 0), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_discard(disk, 0, 0, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_discard(disk, 100, 4096, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_discard(disk, size, 4096, 0), VSAN_ERR_OUT_OF_RANGE);
    EXPECT(vsan_disk_discard(disk, UINT64_MAX - 4095, 8192, 0), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_discard(disk, 512, UINT64_MAX - 511, 0), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_discard(disk, 0, 4096, 4), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_discard(disk, 0, 4096, 0), VSAN_OK);

    EXPECT(vsan_disk_write_zeroes(NULL, 0, 4096, 0), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_write_zeroes(disk, 0, 0, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write_zeroes(disk, 0, 1000, 0), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write_zeroes(disk, size - 512, 1024, 0), VSAN_ERR_OUT_OF_RANGE);
    EXPECT(vsan_disk_write_zeroes(disk, UINT64_MAX, 512, 0), VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_write_zeroes(disk, 0, 4096, 0x10), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_write_zeroes(disk, 4096, 4096, VSAN_IO_FUA), VSAN_OK);
    EXPECT(vsan_disk_read(disk, 4096, back, 4096), VSAN_OK);
    bool zeroed = true;
    for (size_t i = 0; i < 4096; i++) {
        zeroed = zeroed && back[i] == 0;
    }
    check(zeroed, "write_zeroes zeroed");
    free(buf);
    free(back);
}

static void async_refusals(vsan_disk *disk, recorder *rec) {
    printf("== asynchronous I/O refused at submission (no callback)\n");
    unsigned char buf[4096] = {0};
    void *wrap = (void *)(UINTPTR_MAX - 1023);
    unsigned before = recorder_calls(rec);

    EXPECT(vsan_disk_submit_read(NULL, 0, buf, 4096, record, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_read(MADE_UP_DISK, 0, buf, 4096, record, rec, 60),
           VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_submit_read(disk, 0, buf, 4096, NULL, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_read(disk, 0, NULL, 4096, record, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_read(disk, 0, buf, 0, record, rec, 60), VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_submit_read(disk, UINT64_MAX - 511, buf, 4096, record, rec, 60),
           VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_submit_read(disk, 0, wrap, 4096, record, rec, 60), VSAN_ERR_OVERFLOW);

    EXPECT(vsan_disk_submit_write(NULL, 0, buf, 4096, 0, record, rec, 60),
           VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_write(disk, 0, buf, 4096, 0, NULL, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_write(disk, 0, NULL, 4096, 0, record, rec, 60),
           VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_write(disk, 0, buf, 0, 0, record, rec, 60),
           VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_submit_write(disk, 0, buf, 4096, 8, record, rec, 60),
           VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_submit_write(disk, UINT64_MAX - 511, buf, 4096, 0, record, rec, 60),
           VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_submit_write(disk, 0, wrap, 4096, 0, record, rec, 60), VSAN_ERR_OVERFLOW);

    EXPECT(vsan_disk_submit_flush(NULL, record, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_flush(disk, NULL, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_flush(MADE_UP_DISK, record, rec, 60), VSAN_ERR_BAD_HANDLE);

    EXPECT(vsan_disk_submit_discard(NULL, 0, 4096, 0, record, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_discard(disk, 0, 4096, 0, NULL, rec, 60), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_discard(disk, 1, UINT64_MAX, 0, record, rec, 60),
           VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_submit_discard(disk, 0, 4096, 2, record, rec, 60),
           VSAN_ERR_INVALID_ARGUMENT);

    EXPECT(vsan_disk_submit_write_zeroes(NULL, 0, 4096, 0, record, rec, 60),
           VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_write_zeroes(disk, 0, 4096, 0, NULL, rec, 60),
           VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_submit_write_zeroes(disk, UINT64_MAX, 4096, 0, record, rec, 60),
           VSAN_ERR_OVERFLOW);
    EXPECT(vsan_disk_submit_write_zeroes(disk, 0, 4096, UINT32_MAX, record, rec, 60),
           VSAN_ERR_INVALID_ARGUMENT);

    check(recorder_calls(rec) == before, "no refused submission called back");
}

static void async_requests_checked_at_submission(vsan_disk *disk, recorder *rec) {
    printf("== asynchronous I/O: bad requests refused at submission, good ones call back\n");
    static unsigned char bufs[8][4096];
    unsigned before = recorder_calls(rec);
    unsigned accepted = 0;
    vsan_geometry geo = {0};
    EXPECT(vsan_disk_geometry(disk, &geo), VSAN_OK);
    memset(bufs[1], 0x42, sizeof bufs[1]);
    /* Requests that break the disk's rules are refused at submission, with the same
     * codes as the blocking calls, and their callback never runs (tags 0, 2, 3, 4, 7).
     * Tag 1: a good write; 5: a good read of it; 6: a flush. */
    EXPECT(vsan_disk_submit_read(disk, geo.size, bufs[0], 4096, record, rec, 0),
           VSAN_ERR_OUT_OF_RANGE);
    accepted += EXPECT(vsan_disk_submit_write(disk, 8192, bufs[1], 4096, VSAN_IO_FUA, record,
                                              rec, 1), VSAN_OK);
    EXPECT(vsan_disk_submit_read(disk, 1, bufs[2], 4096, record, rec, 2),
           VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_submit_write(disk, 0, bufs[3], 100, 0, record, rec, 3),
           VSAN_ERR_INVALID_ARGUMENT);
    EXPECT(vsan_disk_submit_discard(disk, geo.size, 4096, 0, record, rec, 4),
           VSAN_ERR_OUT_OF_RANGE);
    check(recorder_wait(rec, before + accepted), "the first %u completed (the write before "
          "the read that checks it is submitted)", accepted);
    accepted += EXPECT(vsan_disk_submit_read(disk, 8192, bufs[5], 4096, record, rec, 5),
                       VSAN_OK);
    accepted += EXPECT(vsan_disk_submit_flush(disk, record, rec, 6), VSAN_OK);
    EXPECT(vsan_disk_submit_write_zeroes(disk, 256, 512, 0, record, rec, 7),
           VSAN_ERR_INVALID_ARGUMENT);
    if (!check(recorder_wait(rec, before + accepted), "all %u callbacks ran", accepted)) {
        return;
    }
    expect_completion(rec, 1, VSAN_OK, "write");
    expect_completion(rec, 5, VSAN_OK, "read");
    expect_completion(rec, 6, VSAN_OK, "flush");
    for (unsigned tag = 0; tag < 8; tag++) {
        if (tag != 1 && tag != 5 && tag != 6) {
            expect_no_completion(rec, tag, "a refused submission");
        }
    }
    check(memcmp(bufs[5], bufs[1], 4096) == 0, "the read got the write's data");
}

static void blocking_calls_in_callbacks(vsan_node *node, vsan_disk *disk, const char *toml,
                                        const char *config_file) {
    printf("== blocking calls from completion callbacks\n");
    static callback_state s;
    memset(&s, 0, sizeof s);
    pthread_mutex_init(&s.lock, NULL);
    pthread_cond_init(&s.cv, NULL);
    s.node = node;
    s.disk = disk;
    s.toml = toml;
    s.config_file = config_file;
    s.main_thread = pthread_self();
    if (!EXPECT(vsan_disk_open(node, "vol0", &s.extra), VSAN_OK)) {
        return;
    }
    static unsigned char buf[4096];
    if (EXPECT(vsan_disk_submit_read(disk, 0, buf, sizeof buf, blocking_from_callback, &s, 1),
               VSAN_OK) &&
        check(wait_state(&s, first_done), "the callback ran")) {
        printf("     (it ran on %s)\n", s.first_inline ? "the submitting thread, inline"
                                                       : "a library thread");
        expect_code("vsan_disk_read in a callback", s.read_r, VSAN_ERR_WRONG_THREAD);
        check(strstr(s.wrong_thread_message, "callback") != NULL, "the message says why: %s",
              s.wrong_thread_message);
        expect_code("vsan_disk_write in a callback", s.write_r, VSAN_ERR_WRONG_THREAD);
        expect_code("vsan_disk_flush in a callback", s.flush_r, VSAN_ERR_WRONG_THREAD);
        expect_code("vsan_disk_discard in a callback", s.discard_r, VSAN_ERR_WRONG_THREAD);
        expect_code("vsan_disk_write_zeroes in a callback", s.zeroes_r, VSAN_ERR_WRONG_THREAD);
        expect_code("vsan_node_free in a callback", s.node_free_r, VSAN_ERR_WRONG_THREAD);
        expect_code("vsan_node_new_from_toml in a callback", s.node_new_r,
                    VSAN_ERR_WRONG_THREAD);
        expect_code("vsan_node_new_from_file in a callback", s.node_file_r,
                    VSAN_ERR_WRONG_THREAD);
        check(s.node_new_out == (vsan_node *)(uintptr_t)0x5a5a, "out untouched");
        expect_code("vsan_disk_get_status in a callback", s.status_r, VSAN_OK);
        expect_code("vsan_disk_geometry in a callback", s.geometry_r, VSAN_OK);
        expect_code("vsan_disk_free in a callback", s.disk_free_r, VSAN_OK);
        /* The refused vsan_node_free closed nothing. */
        vsan_geometry geo;
        EXPECT(vsan_disk_geometry(disk, &geo), VSAN_OK);
        EXPECT(vsan_disk_read(disk, 0, buf, sizeof buf), VSAN_OK);
        EXPECT(vsan_disk_free(s.extra), VSAN_ERR_BAD_HANDLE);
    }

    /* A chain of submissions from callbacks: past a few inline levels the library runs
     * them on its threads; blocking calls are refused on either. */
    if (EXPECT(vsan_disk_submit_read(disk, 0, s.nested_buf[0], 4096, chain_level, &s, 0),
               VSAN_OK) &&
        check(wait_state(&s, chain_done), "the chain of callbacks ran")) {
        unsigned on_main = 0;
        bool all_refused = true, all_ok = true;
        for (unsigned i = 0; i < s.chain_levels; i++) {
            on_main += s.chain_inline[i];
            all_refused = all_refused && s.chain_flush[i] == VSAN_ERR_WRONG_THREAD;
            all_ok = all_ok && s.chain_result[i] == VSAN_OK && s.chain_submit[i] == VSAN_OK;
        }
        check(s.chain_levels == CHAIN_DEPTH && all_ok,
              "%u levels, each read from inside the previous callback", s.chain_levels);
        check(all_refused, "vsan_disk_flush refused at every level (%u on the submitting "
              "thread, %u on library threads)", on_main, s.chain_levels - on_main);
    }
    pthread_cond_destroy(&s.cv);
    pthread_mutex_destroy(&s.lock);
}

static void handles(vsan_node *node, vsan_disk *disk, recorder *rec) {
    printf("== handles: made up, mixed up, used after close, closed twice\n");
    vsan_geometry geo;
    EXPECT(vsan_disk_free(NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_node_free(NULL), VSAN_ERR_NULL_POINTER);
    EXPECT(vsan_disk_free(MADE_UP_DISK), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_node_free(MADE_UP_NODE), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_free((vsan_disk *)node), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_node_free((vsan_node *)disk), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_geometry(disk, &geo), VSAN_OK);
    check(strstr(last_message(), "vsan_node_free") != NULL, "the last failure named: %s",
          last_message());

    /* An I/O in flight outlives its handle's close. */
    static unsigned char buf[4096];
    vsan_disk *d = NULL;
    if (EXPECT(vsan_disk_open(node, "vol0", &d), VSAN_OK)) {
        unsigned before = recorder_calls(rec);
        EXPECT(vsan_disk_submit_read(d, 0, buf, sizeof buf, record, rec, 20), VSAN_OK);
        EXPECT(vsan_disk_free(d), VSAN_OK);
        if (check(recorder_wait(rec, before + 1), "the read submitted before the close called "
                  "back")) {
            expect_completion(rec, 20, VSAN_OK, "read submitted before the close");
        }
        before = recorder_calls(rec);
        EXPECT(vsan_disk_free(d), VSAN_ERR_BAD_HANDLE);
        fill_sentinel(&geo, sizeof geo);
        EXPECT(vsan_disk_geometry(d, &geo), VSAN_ERR_BAD_HANDLE);
        check(holds_sentinel(&geo, sizeof geo), "out untouched");
        EXPECT(vsan_disk_read(d, 0, buf, sizeof buf), VSAN_ERR_BAD_HANDLE);
        EXPECT(vsan_disk_write(d, 0, buf, sizeof buf, 0), VSAN_ERR_BAD_HANDLE);
        EXPECT(vsan_disk_submit_read(d, 0, buf, sizeof buf, record, rec, 21),
               VSAN_ERR_BAD_HANDLE);
        EXPECT(vsan_disk_submit_flush(d, record, rec, 21), VSAN_ERR_BAD_HANDLE);
        check(recorder_calls(rec) == before, "no callback for the closed handle");
        /* The disk itself stays open for its other handles. */
        EXPECT(vsan_disk_read(disk, 0, buf, sizeof buf), VSAN_OK);
    }
}

static void closing_the_node(vsan_node *node, vsan_disk *disk) {
    printf("== closing the node\n");
    static unsigned char buf[4096];
    vsan_geometry geo;
    EXPECT(vsan_node_free(node), VSAN_OK);
    EXPECT(vsan_node_free(node), VSAN_ERR_BAD_HANDLE);
    vsan_disk *out = (vsan_disk *)(uintptr_t)0x5a5a;
    EXPECT(vsan_disk_open(node, "vol0", &out), VSAN_ERR_BAD_HANDLE);
    check(out == (vsan_disk *)(uintptr_t)0x5a5a, "out untouched");
    /* Its disks' handles went with it. */
    fill_sentinel(&geo, sizeof geo);
    EXPECT(vsan_disk_geometry(disk, &geo), VSAN_ERR_BAD_HANDLE);
    check(holds_sentinel(&geo, sizeof geo), "out untouched");
    EXPECT(vsan_disk_read(disk, 0, buf, sizeof buf), VSAN_ERR_BAD_HANDLE);
    EXPECT(vsan_disk_free(disk), VSAN_ERR_BAD_HANDLE);
}

int main(int argc, char **argv) {
    if (argc > 2) {
        fprintf(stderr, "usage: %s [dir]\n", argv[0]);
        return 2;
    }
    char tmp[] = "/tmp/vsan-bad-args-XXXXXX";
    const char *dir = argc == 2 ? argv[1] : mkdtemp(tmp);
    if (dir == NULL || strchr(dir, '\'') != NULL || strlen(dir) > 900) {
        fprintf(stderr, "bad_args: no usable directory (a short path without quotes)\n");
        return 2;
    }
    char good_file[1024], bad_file[1024], missing_file[1024];
    snprintf(good_file, sizeof good_file, "%s/good.toml", dir);
    snprintf(bad_file, sizeof bad_file, "%s/bad.toml", dir);
    snprintf(missing_file, sizeof missing_file, "%s/missing.toml", dir);
    char *toml = node_toml(dir, "vol0", DISK_SIZE);
    if (toml == NULL || !write_file(good_file, toml) ||
        !write_file(bad_file, "[node]\nid = \"one\"\n")) {
        fprintf(stderr, "bad_args: cannot write the config files in %s\n", dir);
        free(toml);
        return 2;
    }

    recorder rec;
    recorder_init(&rec);
    vsan_node *node = NULL;
    vsan_disk *disk = NULL;

    result_strings();
    last_error_rules();
    node_configs(toml, good_file, bad_file, missing_file);

    printf("== the node the checks run on\n");
    if (EXPECT(vsan_node_new_from_toml(toml, &node), VSAN_OK) &&
        EXPECT(vsan_disk_open(node, "vol0", &disk), VSAN_OK)) {
        disk_opening(node, disk);
        geometry_and_status(node, disk);
        blocking_io(disk);
        async_refusals(disk, &rec);
        async_requests_checked_at_submission(disk, &rec);
        blocking_calls_in_callbacks(node, disk, toml, good_file);
        handles(node, disk, &rec);
        closing_the_node(node, disk);
        node = NULL;
    } else if (node != NULL) {
        vsan_node_free(node);
    }
    /* Every callback has run (the node is closed); none came for a refused submission. */
    unsigned calls = recorder_calls(&rec);
    check(calls == 4, "callbacks in all: %u (one per accepted submission)", calls);
    recorder_destroy(&rec);

    free(toml);
    remove(good_file);
    remove(bad_file);
    if (argc < 2) {
        rmdir(dir);
    }
    printf("bad_args: %u checks, %u failed\n", checks, failures);
    if (failures == 0) {
        printf("bad_args: OK\n");
        return 0;
    }
    printf("bad_args: FAILED\n");
    return 1;
}
