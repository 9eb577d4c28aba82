//! Where a tenant's `ADD <url>` may lead (56.2, in part): the builder
//! fetches it itself, from the host's network namespace, so a URL at
//! loopback (the agent's metrics, every local listener), at a bridge or
//! mesh address (another tenant's unpublished port, a VIP) or at
//! link-local metadata would bring the node's inside into the build. Such a
//! URL is refused before any builder runs: an address literal that is not
//! public, or a name that resolves to one.
//!
//! Not the whole fix: a name may resolve elsewhere when the builder asks
//! again (DNS rebinding), and a `# syntax=` frontend (off unless the
//! operator allows them) parses the file its own way. The builder in a
//! namespace on the build network is the fix that holds; see the README.

use std::time::Duration;

use crate::addr_scope::is_global;

/// How long a name may take to resolve before the build goes on without
/// the answer (the builder then meets the same resolver).
const RESOLVE_WITHIN: Duration = Duration::from_secs(5);

/// Why `url` (an `ADD` source, a git remote) may not be fetched, if it
/// may not: the URL (redacted), where it leads, and the rule.
pub async fn refuses(url: &str) -> Option<String> {
    let why = leads_inward(url).await?;
    Some(format!(
        "{}: {why}; a build fetches only from public addresses",
        crate::redact::url(url)
    ))
}

/// Where `url` leads, when that is not a public address.
async fn leads_inward(url: &str) -> Option<String> {
    let host = host_of(url)?;
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse() {
        return (!is_global(ip)).then(|| format!("{ip} is not a public address"));
    }
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return Some(format!("{host} is this node"));
    }
    let found = tokio::time::timeout(RESOLVE_WITHIN, tokio::net::lookup_host((name.as_str(), 0)))
        .await
        .ok()?
        .ok()?;
    found
        .map(|a| a.ip())
        .find(|ip| !is_global(*ip))
        .map(|ip| format!("{host} resolves to {ip}, which is not a public address"))
}

/// The host a URL or a `git@host:path` remote names.
fn host_of(url: &str) -> Option<String> {
    if let Some(rest) = url.strip_prefix("git@") {
        return rest.split(':').next().map(str::to_owned);
    }
    let parsed = url::Url::parse(url).ok()?;
    parsed.host_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_public_hosts_may_be_fetched() {
        for inward in [
            "http://127.0.0.1:9100/metrics",
            "http://10.201.3.4:8080/t",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::1]:80/",
            "http://localhost:8080/",
            "https://a.localhost/x",
            "git@127.0.0.1:o/r.git",
            "http://2130706433/",
        ] {
            assert!(refuses(inward).await.is_some(), "{inward}");
        }
        for public in ["https://1.1.1.1/x", "git@140.82.112.3:o/r.git", "not a url"] {
            assert_eq!(refuses(public).await, None, "{public}");
        }
    }
}
