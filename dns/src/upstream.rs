//! Which resolvers non-internal queries are relayed to (D-5, with the
//! allowed deviation): the host's `/etc/resolv.conf`, or systemd-resolved's
//! real list when that file names only its stub, re-read when either changes.
//!
//! Unlike the reference, loopback nameservers other than the stub are kept:
//! this resolver runs in the host's network namespace, where a host-local
//! resolver on 127.0.0.1 is reachable (the reference ran inside Docker).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tracing::{info, warn};

/// systemd-resolved's stub listeners.
const RESOLVED_STUBS: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)),
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 54)),
];

const DNS_PORT: u16 = 53;

/// Where the upstream list comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamSource {
    /// A fixed list, for tests and for operators who want one.
    Fixed(Vec<SocketAddr>),
    /// A resolv.conf, and the file to use instead when it names only the
    /// systemd-resolved stub.
    ResolvConf { path: PathBuf, resolved: PathBuf },
}

impl Default for UpstreamSource {
    fn default() -> Self {
        Self::ResolvConf {
            path: PathBuf::from("/etc/resolv.conf"),
            resolved: PathBuf::from("/run/systemd/resolve/resolv.conf"),
        }
    }
}

/// The nameserver addresses of a resolv.conf, in file order. IPv6 zone ids
/// (`fe80::1%eth0`) cannot be carried into a socket address without an
/// interface lookup, so such entries are skipped.
pub fn parse_resolv_conf(text: &str) -> Vec<IpAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "nameserver")
                .then(|| words.next())
                .flatten()
        })
        .filter_map(|addr| addr.parse().ok())
        .collect()
}

/// The live upstream list, swapped whole on change.
#[derive(Debug)]
pub(crate) struct Upstreams {
    source: UpstreamSource,
    current: ArcSwap<Vec<SocketAddr>>,
    seen: std::sync::Mutex<Fingerprint>,
}

/// What we last read, to notice a change without re-parsing every poll.
type Fingerprint = Vec<Option<(SystemTime, u64, u64)>>;

impl Upstreams {
    pub(crate) fn new(source: UpstreamSource) -> Self {
        let seen = fingerprint(&source);
        let list = load(&source);
        log_list(&list);
        Self {
            source,
            current: ArcSwap::from_pointee(list),
            seen: std::sync::Mutex::new(seen),
        }
    }

    pub(crate) fn get(&self) -> Arc<Vec<SocketAddr>> {
        self.current.load_full()
    }

    /// Re-reads the files if their size, mtime or inode changed (an editor
    /// or resolvconf replacing the file changes at least one of them).
    pub(crate) fn refresh(&self) {
        let now = fingerprint(&self.source);
        {
            let Ok(mut seen) = self.seen.lock() else {
                return;
            };
            if *seen == now {
                return;
            }
            *seen = now;
        }
        let list = load(&self.source);
        if *self.current.load_full() != list {
            log_list(&list);
            self.current.store(Arc::new(list));
        }
    }

    /// Polls for changes until the task is aborted.
    pub(crate) async fn watch(self: Arc<Self>, every: Duration) {
        if matches!(self.source, UpstreamSource::Fixed(_)) {
            return;
        }
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // Two tiny files: cheaper in place than a trip to the blocking pool.
            self.refresh();
        }
    }
}

fn log_list(list: &[SocketAddr]) {
    if list.is_empty() {
        warn!("no upstream resolvers: every non-internal query gets SERVFAIL");
    } else {
        info!(upstreams = ?list, "upstream resolvers");
    }
}

fn fingerprint(source: &UpstreamSource) -> Fingerprint {
    use std::os::unix::fs::MetadataExt;
    match source {
        UpstreamSource::Fixed(_) => Vec::new(),
        UpstreamSource::ResolvConf { path, resolved } => [path, resolved]
            .iter()
            .map(|p| {
                let m = std::fs::metadata(p).ok()?;
                Some((m.modified().ok()?, m.len(), m.ino()))
            })
            .collect(),
    }
}

/// Reads the list now. A missing or unreadable file counts as empty.
pub(crate) fn load(source: &UpstreamSource) -> Vec<SocketAddr> {
    match source {
        UpstreamSource::Fixed(list) => list.clone(),
        UpstreamSource::ResolvConf { path, resolved } => {
            let primary = read(path);
            let only_stub =
                !primary.is_empty() && primary.iter().all(|ip| RESOLVED_STUBS.contains(ip));
            let chosen = if only_stub {
                let real = read(resolved);
                // Without resolved's file the stub itself still works from
                // the host namespace: better than SERVFAIL for everything.
                if real.is_empty() { primary } else { real }
            } else {
                primary
            };
            chosen
                .into_iter()
                .map(|ip| SocketAddr::new(ip, DNS_PORT))
                .collect()
        }
    }
}

fn read(path: &Path) -> Vec<IpAddr> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_resolv_conf(&text),
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot read resolver list");
            Vec::new()
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn parses_nameservers_in_order_and_skips_the_rest() {
        let text = "# comment\nsearch example.org\nnameserver 192.0.2.1\n\
                    nameserver  2001:db8::1 \nnameserver fe80::1%eth0\nnameserver bogus\n\
                    ; nameserver 192.0.2.9\noptions edns0\n";
        let got = parse_resolv_conf(text);
        assert_eq!(
            got,
            vec![
                "192.0.2.1".parse::<IpAddr>().unwrap(),
                "2001:db8::1".parse().unwrap()
            ]
        );
    }

    fn write(file: &mut tempfile::NamedTempFile, text: &str) {
        file.as_file().set_len(0).unwrap();
        file.reopen().unwrap().write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn stub_only_uses_resolved_list_and_changes_are_picked_up() {
        let mut main = tempfile::NamedTempFile::new().unwrap();
        let mut real = tempfile::NamedTempFile::new().unwrap();
        write(&mut main, "nameserver 127.0.0.53\noptions edns0 trust-ad\n");
        write(&mut real, "nameserver 192.0.2.7\nnameserver 192.0.2.8\n");
        let source = UpstreamSource::ResolvConf {
            path: main.path().into(),
            resolved: real.path().into(),
        };
        let up = Upstreams::new(source);
        assert_eq!(
            *up.get(),
            vec![
                "192.0.2.7:53".parse::<SocketAddr>().unwrap(),
                "192.0.2.8:53".parse().unwrap()
            ]
        );
        // A host-local resolver that is not the stub is used as is; the new
        // content has another length, so the change is seen.
        write(&mut main, "nameserver 127.0.0.1\n");
        up.refresh();
        assert_eq!(
            *up.get(),
            vec!["127.0.0.1:53".parse::<SocketAddr>().unwrap()]
        );
    }

    #[test]
    fn stub_without_resolved_file_keeps_the_stub() {
        let mut main = tempfile::NamedTempFile::new().unwrap();
        write(&mut main, "nameserver 127.0.0.53\n");
        let source = UpstreamSource::ResolvConf {
            path: main.path().into(),
            resolved: "/nonexistent/zattera-dns-test".into(),
        };
        assert_eq!(
            load(&source),
            vec!["127.0.0.53:53".parse::<SocketAddr>().unwrap()]
        );
    }
}
