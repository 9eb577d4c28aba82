//! The images a tenant's Dockerfile may read: from registries only.
//!
//! buildah takes a transport in an image name: `FROM oci-archive:/path`,
//! `docker-archive:`, `dir:`, `oci:` read an image from the node's own
//! files, and `containers-storage:` from a storage on the node (the
//! agent's own holds every tenant's cached builds). Any of them in a
//! tenant's `FROM`, `COPY --from` or `RUN --mount=...,from=` would read
//! the node as root. So every image a Dockerfile names is checked before
//! the build: after the `ARG` values a build would give it (the
//! Dockerfile's defaults, then the request's build args), it must not
//! start with a local transport. BuildKit's frontend takes none of these,
//! so the check costs it nothing.

use std::collections::{BTreeMap, HashMap};

/// containers/image transports that read from the node itself.
const LOCAL_TRANSPORTS: [&str; 9] = [
    "containers-storage",
    "dir",
    "docker-archive",
    "docker-daemon",
    "oci",
    "oci-archive",
    "ostree",
    "sif",
    "tarball",
];

/// A Dockerfile larger than this is refused rather than read.
const MAX_DOCKERFILE: u64 = 1 << 20;

/// The Dockerfile at `path`, up to [`MAX_DOCKERFILE`] bytes.
pub fn read_dockerfile(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_DOCKERFILE + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("reading the Dockerfile: {e}"))?;
    if bytes.len() as u64 > MAX_DOCKERFILE {
        return Err(format!(
            "the Dockerfile is larger than {MAX_DOCKERFILE} bytes"
        ));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The first image of `dockerfile` that names a local transport, as
/// (the name as resolved, the transport).
pub fn local_image(
    dockerfile: &str,
    build_args: &BTreeMap<String, String>,
) -> Option<(String, &'static str)> {
    let mut args: HashMap<String, String> = HashMap::new();
    for line in instructions(dockerfile) {
        let mut words = line.split_whitespace();
        let Some(keyword) = words.next() else {
            continue;
        };
        let rest: Vec<&str> = words.collect();
        let named: Vec<String> = match keyword.to_ascii_uppercase().as_str() {
            "ARG" => {
                for decl in &rest {
                    let (name, default) = decl.split_once('=').unwrap_or((decl, ""));
                    let value = build_args
                        .get(name)
                        .cloned()
                        .unwrap_or_else(|| expand(unquote(default), &args));
                    args.insert(name.to_owned(), value);
                }
                continue;
            }
            // The first word that is not a flag is the image.
            "FROM" => rest
                .iter()
                .find(|w| !w.starts_with("--"))
                .map(|w| (*w).to_owned())
                .into_iter()
                .collect(),
            "COPY" | "ADD" | "RUN" => rest
                .iter()
                .take_while(|w| w.starts_with("--"))
                .filter_map(|flag| from_in_flag(flag))
                .collect(),
            _ => continue,
        };
        for image in named {
            let image = expand(unquote(&image), &args);
            if let Some(transport) = transport_of(&image) {
                return Some((image, transport));
            }
        }
    }
    None
}

/// The image a flag names: `--from=X`, or `from=X` inside `--mount=...`.
fn from_in_flag(flag: &str) -> Option<String> {
    let flag = flag.trim_start_matches('-');
    if let Some(v) = flag.strip_prefix("from=") {
        return Some(v.to_owned());
    }
    let mount = flag.strip_prefix("mount=")?;
    mount
        .split(',')
        .find_map(|kv| kv.strip_prefix("from="))
        .map(str::to_owned)
}

/// The local transport `image` starts with, if any. A registry name with a
/// port (`host:5000/app`) has no transport: its part before `:` is a host.
fn transport_of(image: &str) -> Option<&'static str> {
    let (head, _) = image.split_once(':')?;
    let head = head.to_ascii_lowercase();
    LOCAL_TRANSPORTS.into_iter().find(|t| *t == head)
}

/// The Dockerfile's instructions, one line each: continuations joined,
/// comments and blank lines dropped.
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        if current.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        if !line.starts_with('#') {
            current.push_str(line);
        }
        out.push(std::mem::take(&mut current));
    }
    if !current.trim().is_empty() {
        out.push(current);
    }
    out
}

fn unquote(s: &str) -> &str {
    s.trim_matches(|c| c == '"' || c == '\'')
}

/// `$NAME`, `${NAME}`, `${NAME:-default}` and `${NAME:+alt}` from `args`
/// (an unset one is empty, as the builders take it).
fn expand(text: &str, args: &HashMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(body) = after.strip_prefix('{') {
            let Some(end) = body.find('}') else {
                out.push_str(&rest[at..]);
                return out;
            };
            let inner = &body[..end];
            let value = if let Some((name, default)) = inner.split_once(":-") {
                args.get(name)
                    .filter(|v| !v.is_empty())
                    .cloned()
                    .unwrap_or_else(|| default.to_owned())
            } else if let Some((name, alt)) = inner.split_once(":+") {
                if args.get(name).is_some_and(|v| !v.is_empty()) {
                    alt.to_owned()
                } else {
                    String::new()
                }
            } else {
                args.get(inner).cloned().unwrap_or_default()
            };
            out.push_str(&value);
            rest = &body[end + 1..];
        } else {
            let len = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            out.push_str(args.get(&after[..len]).map_or("", String::as_str));
            rest = &after[len..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(dockerfile: &str) -> Option<(String, &'static str)> {
        local_image(dockerfile, &BTreeMap::new())
    }

    #[test]
    fn registry_images_and_stages_pass() {
        for ok in [
            "FROM busybox\nRUN true\n",
            "FROM 10.90.0.1:5000/p/app:1 AS build\nFROM scratch\nCOPY --from=build /a /a\n",
            "FROM --platform=$BUILDPLATFORM localhost:5000/base@sha256:abc\n",
            "FROM docker://busybox\n",
            "ARG BASE=node:20\nFROM ${BASE}\nRUN --mount=type=cache,target=/root/.npm npm ci\n",
            "# FROM oci-archive:/x is only a comment\nFROM alpine\n",
        ] {
            assert_eq!(check(ok), None, "{ok}");
        }
    }

    #[test]
    fn every_way_of_naming_a_local_image_is_found() {
        for (bad, transport) in [
            ("FROM oci-archive:/var/lib/x.tar\n", "oci-archive"),
            ("from docker-archive:/root/img.tar as a\n", "docker-archive"),
            (
                "FROM --platform=linux/amd64 containers-storage:abc\n",
                "containers-storage",
            ),
            ("FROM alpine\nCOPY --from=dir:/etc /x /y\n", "dir"),
            (
                "FROM alpine\nRUN --mount=type=bind,from=oci:/srv/layout,target=/m cat /m/x\n",
                "oci",
            ),
            ("ARG B=oci-archive:/x.tar\nFROM $B\n", "oci-archive"),
            (
                "ARG T=archive\nFROM \"docker-${T}:/x.tar\"\n",
                "docker-archive",
            ),
            ("ARG B\nFROM ${B:-tarball:/x}\n", "tarball"),
            ("FROM \\\n  OCI-ARCHIVE:/x.tar\n", "oci-archive"),
        ] {
            assert_eq!(check(bad).map(|(_, t)| t), Some(transport), "{bad}");
        }
    }

    #[test]
    fn a_build_arg_overrides_the_default_both_ways() {
        let df = "ARG BASE=alpine\nFROM $BASE\n";
        let evil = BTreeMap::from([("BASE".to_owned(), "sif:/x".to_owned())]);
        assert_eq!(local_image(df, &evil), Some(("sif:/x".to_owned(), "sif")));
        let df = "ARG BASE=dir:/x\nFROM $BASE\n";
        let fine = BTreeMap::from([("BASE".to_owned(), "alpine".to_owned())]);
        assert_eq!(local_image(df, &fine), None);
    }
}
