//! Runs `nft` on our table, and nothing else: the only commands sent are a
//! rebuild, a delete and a list of `inet <table>`. `nft` runs as a child
//! process of the async runtime, so a rebuild never blocks a worker thread.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;

use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::error::{Error, Result};
use crate::firewall::{FirewallState, Proto, PublishedPort, render};

/// The contents of our table, as read back by [`Nft::current`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Current {
    pub bridges: Vec<String>,
    pub published: Vec<PublishedPort>,
    pub vips: Vec<Ipv4Addr>,
    /// `(bridge, vip)` pairs of the `vip_access` set.
    pub vip_access: Vec<(String, Ipv4Addr)>,
}

/// The agent's nftables table.
#[derive(Debug, Clone)]
pub struct Nft {
    binary: PathBuf,
    table: String,
}

impl Nft {
    pub fn new(binary: impl Into<PathBuf>, table: impl Into<String>) -> Self {
        Self {
            binary: binary.into(),
            table: table.into(),
        }
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Replaces the table with `state`, atomically.
    pub async fn apply(&self, state: &FirewallState) -> Result<()> {
        self.run("rebuild", &["-f", "-"], Some(&render(&self.table, state)))
            .await
            .map(drop)
    }

    /// Deletes the table; an absent table is fine.
    pub async fn delete(&self) -> Result<()> {
        let t = &self.table;
        let script = format!("table inet {t}\ndelete table inet {t}\n");
        self.run("delete", &["-f", "-"], Some(&script))
            .await
            .map(drop)
    }

    /// The table as `nft list` prints it, or `None` when it does not exist.
    pub async fn list(&self) -> Result<Option<String>> {
        match self
            .run("list", &["list", "table", "inet", &self.table], None)
            .await
        {
            Ok(out) => Ok(Some(out)),
            Err(Error::Nft { stderr, .. }) if stderr.contains("No such file or directory") => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The published ports our table holds now, read back from its maps.
    pub async fn published(&self) -> Result<Vec<PublishedPort>> {
        Ok(self
            .read_json()
            .await?
            .map_or_else(Vec::new, |doc| parse_published(&doc)))
    }

    /// What the table holds now: bridge names, published ports and VIPs,
    /// or `None` when there is no table. Lets a restarted agent change one
    /// network's rules without first knowing all of them.
    pub async fn current(&self) -> Result<Option<Current>> {
        Ok(self.read_json().await?.map(|doc| Current {
            bridges: set_elements(&doc, "bridges"),
            published: parse_published(&doc),
            vips: set_elements(&doc, "vips")
                .iter()
                .filter_map(|v| v.parse().ok())
                .collect(),
            vip_access: pair_elements(&doc, "vip_access"),
        }))
    }

    async fn read_json(&self) -> Result<Option<Value>> {
        let json = match self
            .run("list", &["-j", "list", "table", "inet", &self.table], None)
            .await
        {
            Ok(out) => out,
            Err(Error::Nft { stderr, .. }) if stderr.contains("No such file or directory") => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        serde_json::from_str(&json)
            .map(Some)
            .map_err(|e| Error::Nft {
                action: "parse",
                table: self.table.clone(),
                stderr: e.to_string(),
            })
    }

    async fn run(
        &self,
        action: &'static str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String> {
        let failed = |stderr: String| Error::Nft {
            action,
            table: self.table.clone(),
            stderr,
        };
        let mut child = Command::new(&self.binary)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::NftMissing {
                binary: self.binary.clone(),
                source,
            })?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A write error shows up as nft's own failure below.
            let _ = pipe.write_all(text.as_bytes()).await;
        }
        let out = child
            .wait_with_output()
            .await
            .map_err(|e| failed(format!("waiting for nft: {e}")))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(failed(
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ))
        }
    }
}

fn items(doc: &Value) -> &[Value] {
    doc.get("nftables")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
}

/// The raw elements of one of our sets.
fn elements<'a>(doc: &'a Value, name: &str) -> impl Iterator<Item = &'a Value> {
    items(doc)
        .iter()
        .filter_map(|i| i.get("set"))
        .filter(move |set| set.get("name").and_then(Value::as_str) == Some(name))
        .filter_map(|set| set.get("elem").and_then(Value::as_array))
        .flatten()
}

/// The (string) elements of one of our sets.
fn set_elements(doc: &Value, name: &str) -> Vec<String> {
    elements(doc, name)
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect()
}

/// The `ifname . ipv4_addr` elements of one of our sets.
fn pair_elements(doc: &Value, name: &str) -> Vec<(String, Ipv4Addr)> {
    elements(doc, name)
        .filter_map(|e| {
            let parts = e.get("concat").and_then(Value::as_array)?;
            let name = parts.first().and_then(Value::as_str)?;
            let ip = parts.get(1).and_then(Value::as_str)?.parse().ok()?;
            Some((name.to_owned(), ip))
        })
        .collect()
}

/// Reads the elements of our `pub_*` / `puball_*` maps out of `nft -j` output.
fn parse_published(doc: &Value) -> Vec<PublishedPort> {
    let mut out = Vec::new();
    for map in items(doc).iter().filter_map(|i| i.get("map")) {
        let name = map.get("name").and_then(Value::as_str).unwrap_or("");
        let (proto, any) = match name {
            "pub_tcp" => (Proto::Tcp, false),
            "pub_udp" => (Proto::Udp, false),
            "puball_tcp" => (Proto::Tcp, true),
            "puball_udp" => (Proto::Udp, true),
            _ => continue,
        };
        let elems = map
            .get("elem")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        for pair in elems.iter().filter_map(Value::as_array) {
            let (Some(key), Some(val)) = (pair.first(), pair.get(1)) else {
                continue;
            };
            let (host_ip, host_port) = if any {
                (Some(Ipv4Addr::UNSPECIFIED), port(key))
            } else {
                concat(key)
            };
            let (container_ip, container_port) = concat(val);
            if let (Some(host_ip), Some(host_port), Some(container_ip), Some(container_port)) =
                (host_ip, host_port, container_ip, container_port)
            {
                out.push(PublishedPort {
                    proto,
                    host_ip,
                    host_port,
                    container_ip,
                    container_port,
                });
            }
        }
    }
    out.sort();
    out
}

fn concat(v: &Value) -> (Option<Ipv4Addr>, Option<u16>) {
    let parts = v.get("concat").and_then(Value::as_array);
    let ip = parts
        .and_then(|p| p.first())
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok());
    (ip, parts.and_then(|p| p.get(1)).and_then(port))
}

fn port(v: &Value) -> Option<u16> {
    v.as_u64().and_then(|n| u16::try_from(n).ok())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    #[test]
    fn published_ports_are_read_back_from_nft_json() {
        let doc: serde_json::Value = serde_json::from_str(
            r#"{"nftables": [{"metainfo": {}},
            {"map": {"name": "pub_tcp", "elem": [[{"concat": ["127.0.0.1", 8080]}, {"concat": ["10.201.5.2", 80]}]]}},
            {"map": {"name": "puball_udp", "elem": [[9090, {"concat": ["10.201.5.3", 53]}]]}},
            {"set": {"name": "bridges", "elem": ["ztbr5", "ztbr6"]}},
            {"set": {"name": "vip_access", "elem": [{"concat": ["ztbr5", "10.97.0.5"]}]}},
            {"map": {"name": "other", "elem": [[1, 2]]}}]}"#,
        )
        .unwrap();
        let got = super::parse_published(&doc);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].host_port, 8080);
        assert_eq!(got[0].container_ip, std::net::Ipv4Addr::new(10, 201, 5, 2));
        assert!(got[1].host_ip.is_unspecified());
        assert_eq!((got[1].host_port, got[1].container_port), (9090, 53));
        assert_eq!(super::set_elements(&doc, "bridges"), ["ztbr5", "ztbr6"]);
        assert_eq!(
            super::pair_elements(&doc, "vip_access"),
            [("ztbr5".to_owned(), std::net::Ipv4Addr::new(10, 97, 0, 5))]
        );
    }
}
