/* Preloaded before libfaketime (tests/reliability/_overlap.py, faketime_env) so that a
   skewed process has only its wall clock off, as a host whose clock is wrong: libfaketime
   runs with FAKETIME_DONT_FAKE_MONOTONIC=1, but 0.9.10 still converts an absolute
   CLOCK_MONOTONIC deadline as if it were a faked wall-clock time (Python's time.sleep
   then fails with EINVAL). Sleeps on any other clock than CLOCK_REALTIME go straight to
   the kernel; every wall-clock call still goes to libfaketime. (With the monotonic clock
   faked instead, as before stop 38, sleeps work but Python's timed thread waits,
   sem_clockwait, which libfaketime does not intercept, never time out: review 99.) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t id, int flags, const struct timespec *req, struct timespec *rem) {
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (id != CLOCK_REALTIME) {
        long r = syscall(SYS_clock_nanosleep, id, flags, req, rem);
        return r == 0 ? 0 : errno; /* clock_nanosleep returns the error number */
    }
    if (!next)
        next = (int (*)(clockid_t, int, const struct timespec *, struct timespec *))dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(id, flags, req, rem);
}
