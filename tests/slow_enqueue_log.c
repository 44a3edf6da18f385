/* LD_PRELOAD shim that makes Horovod 0.28.1's broadcast use-after-free happen every time.
 *
 * EnqueueTensorBroadcast hands the tensor to Horovod's background thread and only then
 * writes the trace line "Enqueued <name>", reading `name` from a structure that the
 * completion callback frees. Sleeping 100 ms after "Enqueued " lets the broadcast finish
 * first, so hvd.broadcast_ crashes or hangs; code that avoids the path is unaffected.
 * Build: gcc -shared -fPIC -o slow_enqueue_log.so slow_enqueue_log.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <unistd.h>

#define OSTREAM_INSERT "_ZSt16__ostream_insertIcSt11char_traitsIcEERSt13basic_ostreamIT_T0_ES6_PKS3_l"

typedef void *(*insert_fn)(void *, const char *, long);

void *ostream_insert(void *os, const char *text, long length) __asm__(OSTREAM_INSERT);

void *ostream_insert(void *os, const char *text, long length) {
  static insert_fn real;
  if (!real)
    real = (insert_fn)dlvsym(dlopen("libstdc++.so.6", RTLD_NOW | RTLD_NOLOAD),
                             OSTREAM_INSERT, "GLIBCXX_3.4.9");
  void *out = real(os, text, length);
  if (length == 9 && memcmp(text, "Enqueued ", 9) == 0)
    usleep(100000);
  return out;
}
