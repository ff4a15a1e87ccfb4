/* A network round trip for a FUSE client on loopback: LD_PRELOADed into a GlusterFS
   client (benchmarks/network.py --rtt-us N), every write to a TCP socket -- each
   request the client sends its brick -- waits FSSTORE_RTT_US microseconds first.
   Gluster's own debug.delay-gen did not delay as configured here. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>

static long rtt_us = -1;

static void wait_if_tcp(int fd) {
    struct stat st;
    struct sockaddr_storage sa;
    socklen_t len = sizeof sa;
    if (rtt_us < 0) {
        const char *v = getenv("FSSTORE_RTT_US");
        rtt_us = v ? atol(v) : 0;
    }
    if (rtt_us <= 0 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return;
    if (getsockname(fd, (struct sockaddr *)&sa, &len) != 0) return;
    if (sa.ss_family != AF_INET && sa.ss_family != AF_INET6) return;
    struct timespec ts = {rtt_us / 1000000, (rtt_us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

ssize_t writev(int fd, const struct iovec *iov, int n) {
    static ssize_t (*real)(int, const struct iovec *, int);
    if (!real) real = (ssize_t (*)(int, const struct iovec *, int))dlsym(RTLD_NEXT, "writev");
    wait_if_tcp(fd);
    return real(fd, iov, n);
}

ssize_t sendmsg(int fd, const struct msghdr *m, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real) real = (ssize_t (*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    wait_if_tcp(fd);
    return real(fd, m, flags);
}
