/* proctor landlock-exec: apply one Landlock ruleset to itself, drop every capability, then exec argv.
 *
 * Usage: landlock-exec FS_HANDLED NET_HANDLED SCOPED NETNS [relay=PORT:SOCKET] [MASK:PATH]... -- ARGV...
 * NETNS 1: first move into a new, empty network namespace (root only; Landlock has no UDP rights).
 * relay=PORT:SOCKET: listen on 127.0.0.1:PORT (0: any free port) before confining, allow TCP connect to that
 * port only, set HTTPS_PROXY & co. to it, and after confining fork a relay that forwards each connection
 * to the host's egress proxy on the Unix socket SOCKET (proctor/mechanisms/confine/egress.py). With NETNS 1 the new
 * namespace's `lo` is brought up first. The relay runs under the same ruleset, holds no capability, has
 * /dev/null for stdio, and dies with the agent (PR_SET_PDEATHSIG; under bwrap the pid namespace too).
 * The masks are decided in Python (proctor/mechanisms/confine/landlock.py); this program only makes the syscalls, so
 * it stays small enough to read in one sitting. Any failure exits 126 before exec: never run unconfined.
 * Why C and not Python: a `python -I -S` helper with ctypes took 16 ms per start here, this 1.7 ms (plain
 * `true` 1.1 ms; 2026-12-02, 100 interleaved runs). See helper.py.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <linux/capability.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif

struct ruleset_attr { uint64_t fs, net, scoped; };
struct path_beneath { uint64_t allowed; int32_t parent_fd; } __attribute__((packed));
struct net_port { uint64_t allowed; uint64_t port; } __attribute__((packed));
#define NET_CONNECT_TCP 2

static void die(const char *what, const char *arg) {
    fprintf(stderr, "proctor-landlock: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(errno));
    exit(126);
}

static uint64_t num(const char *s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) { errno = EINVAL; die("bad number", s); }
    return v;
}

static void drop_caps(void) {
    /* Root keeps its capabilities under Landlock (CapEff 000001fffeffffff, research/sandbox.md 2c):
     * mknod, module loading and raw sockets would bypass the ruleset, so all of them go. A process that
     * holds none (non-root, or inside bwrap --cap-drop ALL) cannot drop the bounding set and need not:
     * with no_new_privs, exec never grants more than the caller's permitted set. */
    struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) != 0) die("capget", NULL);
    if (data[0].permitted | data[1].permitted | data[0].effective | data[1].effective) {
        for (int cap = 0; cap <= 63; cap++) {
            if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1 && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
                die("drop bounding capability", NULL);
        }
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        die("clear ambient capabilities", NULL);
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) != 0) die("capset", NULL);
}


static void lo_up(void) {
    struct ifreq ifr;
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) die("socket for lo", NULL);
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) != 0) die("SIOCGIFFLAGS lo", NULL);
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) != 0) die("bring lo up", NULL);
    close(s);
}

static int relay_listen(unsigned port, unsigned *bound) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int one = 1, s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) die("relay socket", NULL);
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(s, (struct sockaddr *)&a, sizeof a) != 0) die("relay bind 127.0.0.1", NULL);
    if (listen(s, 64) != 0) die("relay listen", NULL);
    if (getsockname(s, (struct sockaddr *)&a, &len) != 0) die("relay getsockname", NULL);
    *bound = ntohs(a.sin_port);
    return s;
}

static void set_proxy_env(unsigned port) {
    static const char *names[] = { "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                   "all_proxy" };
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u", port);
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (setenv(names[k], url, 1) != 0) die("setenv", names[k]);
    if (setenv("NO_PROXY", "", 1) || setenv("no_proxy", "", 1)) die("setenv", "NO_PROXY");
}

/* Copy both ways until both sides are done; a half-close is passed on. */
static void pump(int a, int b) {
    char buf[65536];
    int open_a = 1, open_b = 1;
    while (open_a || open_b) {
        struct pollfd p[2] = { { open_a ? a : -1, POLLIN, 0 }, { open_b ? b : -1, POLLIN, 0 } };
        if (poll(p, 2, -1) < 0) { if (errno == EINTR) continue; return; }
        for (int k = 0; k < 2; k++) {
            int from = k ? b : a, to = k ? a : b;
            if (!(p[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            ssize_t n = read(from, buf, sizeof buf);
            if (n <= 0) {
                if (n < 0 && errno == EINTR) continue;
                if (n < 0) return;
                shutdown(to, SHUT_WR);
                if (k) open_b = 0; else open_a = 0;
                continue;
            }
            for (ssize_t off = 0; off < n;) {
                ssize_t w = write(to, buf + off, n - off);
                if (w < 0) { if (errno == EINTR) continue; return; }
                off += w;
            }
        }
    }
}

static void relay_loop(int lfd, const char *path) {
    struct sockaddr_un un;
    memset(&un, 0, sizeof un);
    un.sun_family = AF_UNIX;
    strncpy(un.sun_path, path, sizeof un.sun_path - 1);
    signal(SIGCHLD, SIG_IGN);  /* children reap themselves */
    signal(SIGPIPE, SIG_IGN);
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) { if (errno == EINTR || errno == ECONNABORTED) continue; if (errno == EMFILE) sleep(1); continue; }
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
            close(lfd);
            int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (u >= 0 && connect(u, (struct sockaddr *)&un, sizeof un) == 0) pump(c, u);
            _exit(0);
        }
        close(c);
    }
}

static void start_relay(int lfd, const char *path) {
    pid_t agent = getpid();
    pid_t pid = fork();
    if (pid < 0) die("fork relay", NULL);
    if (pid > 0) { close(lfd); return; }
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || getppid() != agent) _exit(0);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) { dup2(null, 0); dup2(null, 1); dup2(null, 2); }
    /* Nothing of the agent's but the listening socket: its pipes would otherwise stay open past its exit. */
    if (lfd != 3) { if (dup2(lfd, 3) < 0) _exit(0); close(lfd); lfd = 3; }
    if (syscall(436 /* close_range */, 4U, ~0U, 0) != 0)
        for (int fd = 4; fd < 65536; fd++) close(fd);
    relay_loop(lfd, path);
    _exit(0);
}

int main(int argc, char **argv) {
    if (argc < 6) {
        errno = EINVAL;
        die("usage: FS NET SCOPED NETNS [relay=PORT:SOCKET] [MASK:PATH]... -- ARGV", NULL);
    }
    struct ruleset_attr attr = { num(argv[1]), num(argv[2]), num(argv[3]) };
    /* Older ABIs reject a larger struct with non-zero tail, so pass the shortest size that holds it. */
    size_t size = attr.scoped ? 24 : attr.net ? 16 : 8;
    int rs = syscall(SYS_landlock_create_ruleset, &attr, size, 0);
    if (rs < 0) die("landlock_create_ruleset", NULL);
    int netns = num(argv[4]) != 0;
    int i = 5;
    const char *relay_path = NULL;
    unsigned relay_port = 0;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strncmp(argv[i], "relay=", 6) == 0) {
            char *colon = strchr(argv[i] + 6, ':');
            if (!colon || strlen(colon + 1) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
                errno = EINVAL; die("bad relay", argv[i]);
            }
            *colon = '\0';
            relay_port = (unsigned)num(argv[i] + 6);
            if (relay_port > 65535) { errno = EINVAL; die("bad relay port", argv[i] + 6); }
            relay_path = colon + 1;
            continue;
        }
        char *colon = strchr(argv[i], ':');
        if (!colon) { errno = EINVAL; die("bad rule", argv[i]); }
        *colon = '\0';
        struct path_beneath pb = { num(argv[i]), open(colon + 1, O_PATH | O_CLOEXEC) };
        /* A path gone since the plan was made (a sibling under /tmp another process removed) gets no rule:
           no rights, fail-closed, rather than a refused job (a race seen under load). */
        if (pb.parent_fd < 0 && errno == ENOENT) continue;
        if (pb.parent_fd < 0) die("open", colon + 1);
        if (syscall(SYS_landlock_add_rule, rs, 1 /* LANDLOCK_RULE_PATH_BENEATH */, &pb, 0) != 0)
            die("landlock_add_rule", colon + 1);
        close(pb.parent_fd);
    }
    if (i + 1 >= argc) { errno = EINVAL; die("nothing to run after --", NULL); }
    if (netns && unshare(CLONE_NEWNET) != 0) die("unshare(CLONE_NEWNET)", NULL);
    int relay_fd = -1;
    if (relay_path) {
        if (netns) lo_up();
        unsigned bound;
        relay_fd = relay_listen(relay_port, &bound);
        set_proxy_env(bound);
        if (attr.net & NET_CONNECT_TCP) {  /* the one TCP port the agent may connect to */
            struct net_port np = { NET_CONNECT_TCP, bound };
            if (syscall(SYS_landlock_add_rule, rs, 2 /* LANDLOCK_RULE_NET_PORT */, &np, 0) != 0)
                die("landlock_add_rule relay port", NULL);
        }
    }
    drop_caps();
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("no_new_privs", NULL);
    if (syscall(SYS_landlock_restrict_self, rs, 0) != 0) die("landlock_restrict_self", NULL);
    close(rs);
    if (relay_fd >= 0) start_relay(relay_fd, relay_path);
    execvp(argv[i + 1], &argv[i + 1]);
    fprintf(stderr, "proctor-landlock: exec %s: %s\n", argv[i + 1], strerror(errno));
    return 127;
}
