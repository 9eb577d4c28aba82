//! Image references, normalised the way Docker does (runtime.md C-2):
//! `busybox` → `docker.io/library/busybox:latest`,
//! `ghcr.io/a/b@sha256:…` stays digest-pinned, `localhost:5000/x` keeps its
//! registry. The normalised form names both the pull and the image record.

use std::fmt;
use std::str::FromStr;

use super::digest::Digest;

const DOCKER_HUB: &str = "docker.io";

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageRef {
    /// Registry host, with port when given.
    domain: String,
    /// Repository path inside the registry, e.g. `library/busybox`.
    path: String,
    tag: Option<String>,
    digest: Option<Digest>,
}

impl ImageRef {
    pub fn domain(&self) -> &str {
        &self.domain
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    pub fn digest(&self) -> Option<&Digest> {
        self.digest.as_ref()
    }

    /// What to ask the registry's manifest endpoint for: the digest when
    /// pinned, the tag otherwise.
    pub fn manifest_reference(&self) -> &str {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.as_str(),
            (None, Some(t)) => t,
            (None, None) => "latest",
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.domain, self.path)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid image reference {reference:?}: {reason}")]
pub struct InvalidReference {
    pub reference: String,
    pub reason: String,
}

impl FromStr for ImageRef {
    type Err = InvalidReference;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason: &str| InvalidReference {
            reference: s.to_owned(),
            reason: reason.to_owned(),
        };
        if s.is_empty() {
            return Err(fail("empty"));
        }
        if s.len() > 4096 {
            return Err(fail("longer than 4096 characters"));
        }

        let (rest, digest) = match s.split_once('@') {
            Some((rest, d)) => (
                rest,
                Some(d.parse::<Digest>().map_err(|e| fail(&e.to_string()))?),
            ),
            None => (s, None),
        };
        // A colon after the last slash separates the tag; one before it is a port.
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        if let Some(t) = tag {
            validate_tag(t).map_err(|r| fail(&r))?;
        }

        let (domain, path) = match name.split_once('/') {
            Some((first, rest))
                if first.contains(['.', ':'])
                    || first == "localhost"
                    || first.chars().any(|c| c.is_ascii_uppercase()) =>
            {
                (first.to_owned(), rest.to_owned())
            }
            _ => (DOCKER_HUB.to_owned(), name.to_owned()),
        };
        let domain = if domain == "index.docker.io" {
            DOCKER_HUB.to_owned()
        } else {
            domain
        };
        validate_domain(&domain).map_err(|r| fail(&r))?;
        let path = if domain == DOCKER_HUB && !path.contains('/') {
            format!("library/{path}")
        } else {
            path
        };
        validate_path(&path).map_err(|r| fail(&r))?;

        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, Some(_)) => None,
            (None, None) => Some("latest".to_owned()),
        };
        Ok(Self {
            domain,
            path,
            tag,
            digest,
        })
    }
}

fn validate_tag(tag: &str) -> Result<(), String> {
    let mut chars = tag.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    if !first_ok
        || tag.len() > 128
        || !chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
    {
        return Err(format!(
            "tag {tag:?} must be 1 to 128 of [A-Za-z0-9_.-], not starting with '.' or '-'"
        ));
    }
    Ok(())
}

fn validate_domain(domain: &str) -> Result<(), String> {
    let (host, port) = match domain.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (domain, None),
    };
    if host.is_empty()
        || !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-'))
    {
        return Err(format!("registry host {host:?} is not a host name"));
    }
    if let Some(p) = port {
        p.parse::<u16>()
            .map_err(|_| format!("registry port {p:?} is not a port number"))?;
    }
    Ok(())
}

fn validate_path(path: &str) -> Result<(), String> {
    for component in path.split('/') {
        let ok = !component.is_empty()
            && component.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')
            })
            && component.starts_with(|c: char| c.is_ascii_alphanumeric())
            && component.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !ok {
            return Err(format!(
                "repository component {component:?} must be lowercase letters and digits joined by '.', '_' or '-'"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        s.parse::<ImageRef>().unwrap().to_string()
    }

    #[test]
    fn normalises_like_docker() {
        let d = format!("sha256:{}", "a".repeat(64));
        let cases = [
            ("busybox", "docker.io/library/busybox:latest".to_owned()),
            ("busybox:1.36", "docker.io/library/busybox:1.36".to_owned()),
            ("nginx/unit", "docker.io/nginx/unit:latest".to_owned()),
            (
                "docker.io/nginx",
                "docker.io/library/nginx:latest".to_owned(),
            ),
            (
                "index.docker.io/library/nginx:alpine",
                "docker.io/library/nginx:alpine".to_owned(),
            ),
            ("localhost/app", "localhost/app:latest".to_owned()),
            ("localhost:5000/app:v1", "localhost:5000/app:v1".to_owned()),
            (
                "127.0.0.1:5000/a/b/c",
                "127.0.0.1:5000/a/b/c:latest".to_owned(),
            ),
            ("ghcr.io/org/app", "ghcr.io/org/app:latest".to_owned()),
            (
                &format!("busybox@{d}"),
                format!("docker.io/library/busybox@{d}"),
            ),
            (
                &format!("busybox:1@{d}"),
                format!("docker.io/library/busybox:1@{d}"),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(norm(input), want, "{input}");
        }
    }

    #[test]
    fn manifest_reference_prefers_digest() {
        let d = format!("sha256:{}", "b".repeat(64));
        let r: ImageRef = format!("x:1@{d}").parse().unwrap();
        assert_eq!(r.manifest_reference(), d);
        let r: ImageRef = "x".parse().unwrap();
        assert_eq!(r.manifest_reference(), "latest");
        assert_eq!(r.path(), "library/x");
        assert_eq!(r.domain(), "docker.io");
    }

    #[test]
    fn rejects_malformed_references() {
        for bad in [
            "",
            "UPPER",
            "a//b",
            "a:",
            "a:-tag",
            "a@sha256:short",
            "host:port99999/x",
            "a b",
            "-a",
            "a/b:t/c",
        ] {
            let err = bad.parse::<ImageRef>();
            assert!(
                err.is_err(),
                "{bad:?} parsed as {:?}",
                err.map(|r| r.to_string())
            );
        }
    }

    #[test]
    fn error_names_the_reference() {
        let e = "a b".parse::<ImageRef>().unwrap_err().to_string();
        assert!(e.contains("\"a b\""), "{e}");
    }
}
