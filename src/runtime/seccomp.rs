//! The default seccomp profile of every container: an allow-list with the
//! intent of Docker's default profile, written here as data.
//!
//! Anything not listed fails with EPERM. Left out, among others, because an
//! unprivileged container has no business with them (most need a capability
//! the container lacks anyway, and the filter is the second wall):
//! - namespaces: `unshare`, `setns`, and `clone`/`clone3` with a namespace
//!   flag (user namespaces are the usual first step of a kernel exploit);
//! - keys: `keyctl`, `add_key`, `request_key` (the keyring is not
//!   namespaced);
//! - `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*` (large kernel
//!   attack surface);
//! - mounts: `mount`, `umount2`, `pivot_root`, the new mount API
//!   (`fsopen`, `fsmount`, `move_mount`, `open_tree`, ...);
//! - kernel state: `init_module`, `finit_module`, `delete_module`,
//!   `kexec_load`, `reboot`, `swapon`, `swapoff`, `acct`, `quotactl`,
//!   `syslog`, `lookup_dcookie`, `nfsservctl`, `vhangup`;
//! - clocks: `clock_settime`, `clock_adjtime`, `settimeofday`, `stime`,
//!   `adjtimex`;
//! - `open_by_handle_at` (the "shocker" escape), `name_to_handle_at`,
//!   `process_vm_readv`/`writev`, `kcmp`, `pidfd_getfd`.
//!
//! `clone3` answers ENOSYS, so libc falls back to `clone`, whose flags the
//! filter can check (clone3 passes them in memory).
//!
//! Architectures (a deliberate deviation from Docker, which lists x86_64,
//! x86 and x32 for every amd64 container): the filter covers the host's
//! native ABI, plus its 32-bit companion only for an image built for that
//! companion (`386` on amd64, `arm` on arm64). A syscall through an ABI the
//! filter does not list kills the process (libseccomp's bad-architecture
//! action, SIGSYS), so an amd64 image cannot reach the ia32 compat and x32
//! entry points, a kernel surface with a history of its own bugs.
//! It is also cheaper: runc compiles the filter with libseccomp on every
//! start, once per listed architecture; on this project's test machine a
//! `runc run` of this spec took 32 ms with three architectures and 21 ms
//! with one (18 ms without a filter).

use oci_spec::OciSpecError;
use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder,
    LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder,
};

/// `CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC |
/// CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWTIME`.
const CLONE_NAMESPACE_FLAGS: u64 = 0x0002_0000
    | 0x0200_0000
    | 0x0400_0000
    | 0x0800_0000
    | 0x1000_0000
    | 0x2000_0000
    | 0x4000_0000
    | 0x0000_0080;
const EPERM: u32 = 1;
const ENOSYS: u32 = 38;

/// Allowed unconditionally.
pub const ALLOWED: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "alarm",
    "arch_prctl",
    "bind",
    "brk",
    "cachestat",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chown32",
    "chroot",
    "clock_getres",
    "clock_getres_time64",
    "clock_gettime",
    "clock_gettime64",
    "clock_nanosleep",
    "clock_nanosleep_time64",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_ctl_old",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "epoll_wait_old",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fadvise64_64",
    "fallocate",
    "fanotify_mark",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "fchown",
    "fchown32",
    "fchownat",
    "fcntl",
    "fcntl64",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstat64",
    "fstatat64",
    "fstatfs",
    "fstatfs64",
    "fsync",
    "ftruncate",
    "ftruncate64",
    "futex",
    "futex_requeue",
    "futex_time64",
    "futex_wait",
    "futex_waitv",
    "futex_wake",
    "futimesat",
    "get_mempolicy",
    "get_robust_list",
    "get_thread_area",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "getegid32",
    "geteuid",
    "geteuid32",
    "getgid",
    "getgid32",
    "getgroups",
    "getgroups32",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresgid32",
    "getresuid",
    "getresuid32",
    "getrlimit",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "gettid",
    "gettimeofday",
    "getuid",
    "getuid32",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_pgetevents_time64",
    "io_setup",
    "io_submit",
    "ioctl",
    "ioprio_get",
    "ioprio_set",
    "ipc",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lchown32",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "_llseek",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "lstat64",
    "madvise",
    "map_shadow_stack",
    "mbind",
    "membarrier",
    "memfd_create",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mmap2",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedreceive_time64",
    "mq_timedsend",
    "mq_timedsend_time64",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "nanosleep",
    "newfstatat",
    "_newselect",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "ppoll_time64",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_mrelease",
    "pselect6",
    "pselect6_time64",
    "ptrace",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recv",
    "recvfrom",
    "recvmmsg",
    "recvmmsg_time64",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_rr_get_interval_time64",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "semtimedop_time64",
    "send",
    "sendfile",
    "sendfile64",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "set_mempolicy",
    "set_robust_list",
    "set_thread_area",
    "set_tid_address",
    "setfsgid",
    "setfsgid32",
    "setfsuid",
    "setfsuid32",
    "setgid",
    "setgid32",
    "setgroups",
    "setgroups32",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setregid32",
    "setresgid",
    "setresgid32",
    "setresuid",
    "setresuid32",
    "setreuid",
    "setreuid32",
    "setrlimit",
    "setsid",
    "setsockopt",
    "setuid",
    "setuid32",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "sigprocmask",
    "sigreturn",
    "socket",
    "socketcall",
    "socketpair",
    "splice",
    "stat",
    "stat64",
    "statfs",
    "statfs64",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_gettime64",
    "timer_settime",
    "timer_settime64",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_gettime64",
    "timerfd_settime",
    "timerfd_settime64",
    "times",
    "tkill",
    "truncate",
    "truncate64",
    "ugetrlimit",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimensat_time64",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "waitpid",
    "write",
    "writev",
];

/// `personality` values programs use (Linux, 32-bit emulation, and the
/// query); others change how the kernel treats the process.
const PERSONALITIES: [u64; 4] = [0x0, 0x8, 0x2_0000, 0xffff_ffff];

/// The profile for a container of an image built for `image_architecture`
/// (the OCI name: `amd64`, `386`, `arm64`, ...).
pub fn default_profile(image_architecture: &str) -> Result<LinuxSeccomp, OciSpecError> {
    let mut syscalls: Vec<LinuxSyscall> = vec![
        LinuxSyscallBuilder::default()
            .names(ALLOWED.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
            .action(LinuxSeccompAction::ScmpActAllow)
            .build()?,
        // clone without any namespace flag (the flags are argument 0 on
        // every architecture listed here).
        LinuxSyscallBuilder::default()
            .names(vec!["clone".to_owned()])
            .action(LinuxSeccompAction::ScmpActAllow)
            .args(vec![
                LinuxSeccompArgBuilder::default()
                    .index(0usize)
                    .value(CLONE_NAMESPACE_FLAGS)
                    .value_two(0u64)
                    .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                    .build()?,
            ])
            .build()?,
        LinuxSyscallBuilder::default()
            .names(vec!["clone3".to_owned()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(ENOSYS)
            .build()?,
    ];
    for value in PERSONALITIES {
        syscalls.push(
            LinuxSyscallBuilder::default()
                .names(vec!["personality".to_owned()])
                .action(LinuxSeccompAction::ScmpActAllow)
                .args(vec![
                    LinuxSeccompArgBuilder::default()
                        .index(0usize)
                        .value(value)
                        .op(LinuxSeccompOperator::ScmpCmpEq)
                        .build()?,
                ])
                .build()?,
        );
    }
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActErrno)
        .default_errno_ret(EPERM)
        .architectures(architectures(std::env::consts::ARCH, image_architecture))
        .syscalls(syscalls)
        .build()
}

/// The host's native ABI (`host` as Rust names it), and its 32-bit
/// companion when the image was built for that.
fn architectures(host: &str, image_architecture: &str) -> Vec<Arch> {
    match (host, image_architecture) {
        ("x86_64", "386") => vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86],
        ("x86_64", _) => vec![Arch::ScmpArchX86_64],
        ("aarch64", "arm") => vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm],
        ("aarch64", _) => vec![Arch::ScmpArchAarch64],
        ("riscv64", _) => vec![Arch::ScmpArchRiscv64],
        ("powerpc64", _) => vec![Arch::ScmpArchPpc64le],
        _ => vec![Arch::ScmpArchNative],
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_denies_by_default_and_leaves_out_the_dangerous_calls() {
        let p = default_profile("amd64").unwrap();
        assert_eq!(p.default_action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(p.default_errno_ret(), Some(EPERM));
        let allowed: Vec<&String> = p
            .syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .filter(|s| s.action() == LinuxSeccompAction::ScmpActAllow && s.args().is_none())
            .flat_map(oci_spec::runtime::LinuxSyscall::names)
            .collect();
        for denied in [
            "unshare",
            "setns",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "mount",
            "umount2",
            "pivot_root",
            "init_module",
            "finit_module",
            "delete_module",
            "kexec_load",
            "reboot",
            "clock_settime",
            "settimeofday",
            "open_by_handle_at",
            "perf_event_open",
            "userfaultfd",
            "io_uring_setup",
            "fsopen",
            "move_mount",
            "swapon",
            "clone",
            "clone3",
        ] {
            assert!(
                !allowed.iter().any(|a| *a == denied),
                "{denied} is allowed outright"
            );
        }
        for needed in [
            "read",
            "write",
            "execve",
            "futex",
            "openat",
            "socket",
            "wait4",
            "exit_group",
        ] {
            assert!(allowed.iter().any(|a| *a == needed), "{needed} is missing");
        }
        let mut names: Vec<&&str> = ALLOWED.iter().collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALLOWED.len(), "duplicates in the allow-list");
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["defaultAction"], "SCMP_ACT_ERRNO");
    }

    #[test]
    fn the_32_bit_abi_is_listed_only_for_a_32_bit_image() {
        assert_eq!(architectures("x86_64", "amd64"), vec![Arch::ScmpArchX86_64]);
        assert_eq!(architectures("x86_64", ""), vec![Arch::ScmpArchX86_64]);
        assert_eq!(
            architectures("x86_64", "386"),
            vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86]
        );
        assert_eq!(
            architectures("aarch64", "arm"),
            vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm]
        );
        assert_eq!(
            architectures("aarch64", "arm64"),
            vec![Arch::ScmpArchAarch64]
        );
        // x32 is never listed.
        for image in ["amd64", "386", "arm64", "arm", ""] {
            assert!(!architectures("x86_64", image).contains(&Arch::ScmpArchX32));
        }
    }
}
