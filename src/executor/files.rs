//! The per-container `resolv.conf`, `hosts` and `hostname` files, bind-mounted
//! over the image's (C-10).

use std::fmt::Write as _;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// Writes the three files into `dir` and returns their paths.
pub fn write(
    dir: &Path,
    hostname: &str,
    ip: Option<Ipv4Addr>,
    gateway: Option<Ipv4Addr>,
    host_resolv: &str,
) -> std::io::Result<[(PathBuf, &'static str); 3]> {
    std::fs::create_dir_all(dir)?;
    let resolv = dir.join("resolv.conf");
    let hosts = dir.join("hosts");
    let name = dir.join("hostname");
    atomic_write(&resolv, resolv_conf(gateway, host_resolv).as_bytes())?;
    atomic_write(&hosts, hosts_file(hostname, ip).as_bytes())?;
    atomic_write(&name, format!("{hostname}\n").as_bytes())?;
    Ok([
        (resolv, "/etc/resolv.conf"),
        (hosts, "/etc/hosts"),
        (name, "/etc/hostname"),
    ])
}

#[allow(clippy::disallowed_methods)] // a container's files in the run dir, a tmpfs, written again at every start
fn atomic_write(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::rename(tmp, path)
}

/// With a gateway: it is the only nameserver, with the host's search line and
/// `ndots:0`. Without: the host's file minus loopback nameservers.
pub fn resolv_conf(gateway: Option<Ipv4Addr>, host_resolv: &str) -> String {
    let search = host_resolv
        .lines()
        .find(|l| l.starts_with("search ") || l.starts_with("domain "));
    if let Some(gw) = gateway {
        let mut out = format!("nameserver {gw}\n");
        if let Some(s) = search {
            out.push_str(s.trim());
            out.push('\n');
        }
        out.push_str("options ndots:0\n");
        return out;
    }
    let mut out = String::new();
    let mut servers = 0;
    for line in host_resolv.lines() {
        let mut words = line.split_whitespace();
        if words.next() == Some("nameserver") {
            let loopback = words
                .next()
                .and_then(|a| a.parse::<std::net::IpAddr>().ok())
                .is_some_and(|a| a.is_loopback());
            if loopback {
                continue;
            }
            servers += 1;
        }
        out.push_str(line);
        out.push('\n');
    }
    if servers == 0 {
        out.push_str("nameserver 8.8.8.8\nnameserver 8.8.4.4\n");
    }
    out
}

pub fn hosts_file(hostname: &str, ip: Option<Ipv4Addr>) -> String {
    let mut out = String::from(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n\
         ff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n",
    );
    if let Some(ip) = ip {
        let _ = writeln!(out, "{ip}\t{hostname}");
    }
    out
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn gateway_resolv_conf_keeps_search_and_sets_ndots() {
        let host = "nameserver 127.0.0.53\nsearch corp.example\n";
        assert_eq!(
            resolv_conf(Some(Ipv4Addr::new(10, 201, 3, 1)), host),
            "nameserver 10.201.3.1\nsearch corp.example\noptions ndots:0\n"
        );
    }

    #[test]
    fn host_resolv_conf_drops_loopback_and_falls_back() {
        assert_eq!(
            resolv_conf(None, "nameserver 127.0.0.53\n"),
            "nameserver 8.8.8.8\nnameserver 8.8.4.4\n"
        );
        assert_eq!(
            resolv_conf(None, "nameserver 192.0.2.1\n"),
            "nameserver 192.0.2.1\n"
        );
    }

    #[test]
    fn hosts_has_the_container() {
        let h = hosts_file("abc", Some(Ipv4Addr::new(10, 201, 3, 2)));
        assert!(h.starts_with("127.0.0.1\tlocalhost\n"));
        assert!(h.ends_with("10.201.3.2\tabc\n"));
    }
}
