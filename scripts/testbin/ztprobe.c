/* ztprobe: what a hostile container process tries, for the security tests.
 * Built static by scripts/rig.sh and put into the test image "tools".
 *
 *   ztprobe udp IFACE DST_MAC SRC_IP DST_IP SRC_PORT DST_PORT PAYLOAD
 *       sends one hand-made Ethernet/IPv4/UDP frame out of IFACE (AF_PACKET,
 *       needs CAP_NET_RAW): any source address, any destination, 127.0.0.1
 *       included. PAYLOAD "dns:NAME" sends an A query for NAME.
 *   ztprobe udp-listen PORT
 *       prints "got N bytes from IP:PORT" for every datagram to PORT.
 *   ztprobe syscall NAME
 *       tries one syscall (unshare-user, unshare-net, keyctl, bpf, mount,
 *       init-module, settime, ptrace-attach, perf, ia32-getpid) and prints
 *       "allowed" or "blocked: <errno name>"; exit 0 either way.
 *       ia32-getpid enters the kernel through the 32-bit ABI (int 0x80)
 *       from a 64-bit process, the door to the ia32 compat syscalls.
 *   ztprobe spew MIB_PER_SEC SECONDS
 *       writes numbered 100-byte lines "spew <n> <3 hex digits> ..." to stdout at that rate
 *       (in 10 ms steps), then "spew end <count>": the log tests' heavy writer.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <netinet/ip.h>
#include <netinet/udp.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <time.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static uint16_t csum(const void *data, size_t len) {
    const uint16_t *p = data;
    uint32_t sum = 0;
    while (len > 1) { sum += *p++; len -= 2; }
    if (len) sum += *(const uint8_t *)p;
    while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
    return (uint16_t)~sum;
}

static int parse_mac(const char *s, uint8_t mac[6]) {
    return sscanf(s, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &mac[0], &mac[1], &mac[2], &mac[3], &mac[4], &mac[5]) == 6 ? 0 : -1;
}

static size_t dns_query(const char *name, uint8_t *out) {
    size_t n = 0;
    const uint8_t head[12] = {0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0};
    memcpy(out, head, 12);
    n = 12;
    const char *label = name;
    while (*label) {
        const char *dot = strchr(label, '.');
        size_t len = dot ? (size_t)(dot - label) : strlen(label);
        out[n++] = (uint8_t)len;
        memcpy(out + n, label, len);
        n += len;
        label += len + (dot ? 1 : 0);
    }
    out[n++] = 0;
    out[n++] = 0; out[n++] = 1; /* A */
    out[n++] = 0; out[n++] = 1; /* IN */
    return n;
}

static int udp(int argc, char **argv) {
    if (argc != 9) { fprintf(stderr, "usage: ztprobe udp IFACE DST_MAC SRC_IP DST_IP SRC_PORT DST_PORT PAYLOAD\n"); return 2; }
    uint8_t dmac[6], frame[1500];
    if (parse_mac(argv[3], dmac)) { fprintf(stderr, "bad mac %s\n", argv[3]); return 2; }
    int s = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_IP));
    if (s < 0) { perror("socket(AF_PACKET)"); return 1; }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strncpy(ifr.ifr_name, argv[2], IFNAMSIZ - 1);
    if (ioctl(s, SIOCGIFHWADDR, &ifr) < 0) { perror("SIOCGIFHWADDR"); return 1; }
    int ifindex = (int)if_nametoindex(argv[2]);

    uint8_t payload[512];
    size_t plen;
    if (strncmp(argv[8], "dns:", 4) == 0) plen = dns_query(argv[8] + 4, payload);
    else { plen = strlen(argv[8]); memcpy(payload, argv[8], plen); }

    struct ether_header *eth = (struct ether_header *)frame;
    memcpy(eth->ether_dhost, dmac, 6);
    memcpy(eth->ether_shost, ifr.ifr_hwaddr.sa_data, 6);
    eth->ether_type = htons(ETHERTYPE_IP);
    struct iphdr *ip = (struct iphdr *)(frame + sizeof *eth);
    memset(ip, 0, sizeof *ip);
    ip->version = 4; ip->ihl = 5; ip->ttl = 64; ip->protocol = IPPROTO_UDP;
    ip->tot_len = htons((uint16_t)(sizeof *ip + sizeof(struct udphdr) + plen));
    ip->id = htons(0x2a2a);
    inet_pton(AF_INET, argv[4], &ip->saddr);
    inet_pton(AF_INET, argv[5], &ip->daddr);
    ip->check = csum(ip, sizeof *ip);
    struct udphdr *u = (struct udphdr *)(frame + sizeof *eth + sizeof *ip);
    u->source = htons((uint16_t)atoi(argv[6]));
    u->dest = htons((uint16_t)atoi(argv[7]));
    u->len = htons((uint16_t)(sizeof *u + plen));
    u->check = 0; /* optional over IPv4 */
    memcpy((uint8_t *)u + sizeof *u, payload, plen);
    size_t total = sizeof *eth + sizeof *ip + sizeof *u + plen;

    struct sockaddr_ll to;
    memset(&to, 0, sizeof to);
    to.sll_family = AF_PACKET;
    to.sll_ifindex = ifindex;
    to.sll_halen = 6;
    memcpy(to.sll_addr, dmac, 6);
    for (int i = 0; i < 3; i++) {
        if (sendto(s, frame, total, 0, (struct sockaddr *)&to, sizeof to) < 0) { perror("sendto"); return 1; }
        usleep(100000);
    }
    printf("sent\n");
    return 0;
}

static int udp_listen(const char *port) {
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)atoi(port));
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) < 0) { perror("bind"); return 1; }
    printf("listening on %s\n", port);
    fflush(stdout);
    for (;;) {
        char buf[2048];
        struct sockaddr_in from;
        socklen_t len = sizeof from;
        ssize_t n = recvfrom(s, buf, sizeof buf, 0, (struct sockaddr *)&from, &len);
        if (n < 0) continue;
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &from.sin_addr, ip, sizeof ip);
        printf("got %zd bytes from %s:%u\n", n, ip, ntohs(from.sin_port));
        fflush(stdout);
    }
}

static void verdict(long r) {
    if (r < 0) printf("blocked: %s\n", strerrorname_np(errno) ? strerrorname_np(errno) : "?");
    else printf("allowed\n");
}

static int sys(const char *name) {
    if (!strcmp(name, "unshare-user")) verdict(unshare(CLONE_NEWUSER));
    else if (!strcmp(name, "unshare-net")) verdict(unshare(CLONE_NEWNET));
    else if (!strcmp(name, "keyctl")) verdict(syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 1));
    else if (!strcmp(name, "add-key")) verdict(syscall(SYS_add_key, "user", "zt", "x", 1, -3));
    else if (!strcmp(name, "bpf")) verdict(syscall(SYS_bpf, 0, NULL, 0));
    else if (!strcmp(name, "mount")) verdict(mount("none", "/tmp", "tmpfs", 0, NULL));
    else if (!strcmp(name, "init-module")) verdict(syscall(SYS_init_module, NULL, 0, ""));
    else if (!strcmp(name, "settime")) { struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts); verdict(clock_settime(CLOCK_REALTIME, &ts)); }
    else if (!strcmp(name, "perf")) verdict(syscall(SYS_perf_event_open, NULL, 0, -1, -1, 0));
    else if (!strcmp(name, "getpid")) verdict(getpid());
#if defined(__x86_64__)
    else if (!strcmp(name, "ia32-getpid")) {
        long r; /* 20 is getpid in the i386 table; int 0x80 returns -errno */
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory", "r8", "r9", "r10", "r11");
        if (r < 0) errno = (int)-r;
        verdict(r < 0 ? -1 : r);
    }
#endif
    else { fprintf(stderr, "unknown syscall probe %s\n", name); return 2; }
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int spew(const char *rate_arg, const char *secs_arg) {
    double rate = atof(rate_arg) * 1024 * 1024, secs = atof(secs_arg);
    enum { LINE = 100 };
    static char buf[1 << 20];
    unsigned long n = 0;
    unsigned long long x = 0x9e3779b97f4a7c15ULL;
    double start = now_s(), sent = 0;
    for (;;) {
        double t = now_s() - start;
        if (t >= secs) break;
        double due = rate * (t + 0.01) - sent;
        size_t len = 0;
        while (due >= LINE && len + LINE <= sizeof buf) {
            /* 3 pseudo-random hex digits a line: compresses like real output
             * (about 20x), not like a constant. */
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            int w = snprintf(buf + len, LINE + 1, "spew %012lu %03lx %-77s", n++,
                             (unsigned long)(x & 0xfffUL), "abcdefghijklmnopqrstuvwxyz0123456789");
            (void)w;
            buf[len + LINE - 1] = '\n';
            len += LINE;
            due -= LINE;
        }
        for (size_t off = 0; off < len;) {
            ssize_t w = write(1, buf + off, len - off);
            if (w < 0) { if (errno == EINTR) continue; perror("write"); return 1; }
            off += (size_t)w;
        }
        sent += len;
        double next = (sent / rate) - (now_s() - start);
        if (next > 0) { struct timespec ts = { 0, (long)(next * 1e9) }; nanosleep(&ts, NULL); }
    }
    printf("spew end %lu\n", n);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "spew")) return spew(argv[2], argv[3]);
    if (argc >= 2 && !strcmp(argv[1], "udp")) return udp(argc, argv);
    if (argc == 3 && !strcmp(argv[1], "syscall")) return sys(argv[2]);
    if (argc == 3 && !strcmp(argv[1], "udp-listen")) return udp_listen(argv[2]);
    fprintf(stderr, "usage: ztprobe udp ... | ztprobe syscall NAME\n");
    return 2;
}
