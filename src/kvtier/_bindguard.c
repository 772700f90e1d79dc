/* LD_PRELOAD shim: a wildcard bind() becomes a bind to $KVTIER_BIND_HOST.
 *
 * Mooncake's transfer engine listens on every interface (0.0.0.0 / ::) whatever host it is
 * given, and its TCP protocol serves reads of registered memory to any peer. kvtier starts the
 * processes that embed Mooncake (workers, local store nodes) with this library preloaded and
 * KVTIER_BIND_HOST set to the configured host, so those listeners bind that host only. Binds to
 * a specific address and non-IP sockets pass through untouched. An IPv6 wildcard becomes the
 * IPv4-mapped form of the host (the socket then serves IPv4 on that address only).
 * Not a Python module: kvtier never imports it (see kvtier/bindguard.py).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;
static struct in_addr host;
static int have_host;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *text = getenv("KVTIER_BIND_HOST");
    have_host = text != NULL && inet_pton(AF_INET, text, &host) == 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    pthread_once(&once, init);
    if (have_host && addr != NULL) {
        if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
            struct sockaddr_in a;
            memcpy(&a, addr, sizeof a);
            if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
                a.sin_addr = host;
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
            }
        } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 a;
            memcpy(&a, addr, sizeof a);
            if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&a.sin6_addr.s6_addr[12], &host, 4);
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
            }
        }
    }
    return real_bind(fd, addr, len);
}
