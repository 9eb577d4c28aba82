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

/// Why a tenant's Dockerfile is refused before any builder runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// An image read from the node's own files or storage.
    LocalImage {
        image: String,
        transport: &'static str,
    },
    /// A `# syntax=` frontend: an image that would parse the file its own
    /// way, past this check (allowed only by the operator).
    Frontend(String),
    /// `ARG` values that expand past the bounds (a tenant's way to make
    /// the agent allocate without limit).
    Expansion(String),
    /// An image of another project in the cluster registry.
    OtherProject { image: String, why: String },
    /// `RUN --network=` other than `default` or `none`: steps run in the
    /// node's build network (56.2).
    StepNetwork(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::LocalImage { image, transport } => write!(
                f,
                "image {image:?} reads the node's own files ({transport}:); builds take their images from registries"
            ),
            Self::Frontend(image) => write!(
                f,
                "the Dockerfile asks for the frontend {image:?} (# syntax=); custom frontends are off on this node (build-frontends)"
            ),
            Self::Expansion(why) => write!(f, "the Dockerfile's ARG values {why}"),
            Self::OtherProject { image, why } => write!(f, "image {image:?}: {why}"),
            Self::StepNetwork(network) => write!(
                f,
                "RUN --network={network}: build steps run in this node's build network (only default and none are taken)"
            ),
        }
    }
}

/// The most bytes one expanded value may hold.
const MAX_VALUE: usize = 64 << 10;
/// The most bytes every expansion of one Dockerfile may produce together.
const MAX_EXPANDED: usize = 4 << 20;

/// Checks a tenant's Dockerfile before the build: its parser directives
/// (`# escape=`, `# syntax=`), then every image it names (`FROM`, `COPY
/// --from`, `RUN --mount=...,from=`, `ONBUILD` included) after the `ARG`
/// values a build would give it (the Dockerfile's defaults, then the
/// request's build args), expanded within bounds.
pub fn check(
    dockerfile: &str,
    build_args: &BTreeMap<String, String>,
    allow_frontends: bool,
) -> Result<(), Refused> {
    check_with(dockerfile, build_args, allow_frontends, &|_| None).map(|_| ())
}

/// [`check`], and every image the file names also goes through `foreign`,
/// which says why this build may not use it (another project's image).
/// Also refuses a `RUN --network=` other than `default` and `none`. Returns
/// the URLs the file's `ADD` sources name (expanded), which the builder
/// itself would fetch: the caller vets where they lead (that takes name
/// resolution, which is I/O).
pub fn check_with(
    dockerfile: &str,
    build_args: &BTreeMap<String, String>,
    allow_frontends: bool,
    foreign: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<String>, Refused> {
    let mut fetched = Vec::new();
    let directives = directives(dockerfile);
    if let Some(frontend) = directives.syntax.filter(|_| !allow_frontends) {
        return Err(Refused::Frontend(frontend));
    }
    let mut args: HashMap<String, String> = HashMap::new();
    let mut budget = MAX_EXPANDED;
    for line in instructions(dockerfile, directives.escape) {
        let mut line = line.as_str().trim_start();
        // ONBUILD X runs X in a later build: checked as X.
        while let Some(rest) = strip_keyword(line, "ONBUILD") {
            line = rest;
        }
        let mut words = line.split_whitespace();
        let Some(keyword) = words.next() else {
            continue;
        };
        let rest: Vec<&str> = words.collect();
        let named: Vec<String> = match keyword.to_ascii_uppercase().as_str() {
            "ARG" => {
                for decl in &rest {
                    let (name, default) = decl.split_once('=').unwrap_or((decl, ""));
                    let value = match build_args.get(name) {
                        Some(v) => v.clone(),
                        None => expand(unquote(default), &args, &mut budget)?,
                    };
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
            "COPY" | "ADD" | "RUN" => {
                let flags = rest.iter().take_while(|w| w.starts_with("--"));
                let network = flags.clone().find_map(|f| network_in_flag(f));
                if let Some(network) = network.filter(|_| keyword.eq_ignore_ascii_case("RUN")) {
                    let network = expand(unquote(network), &args, &mut budget)?;
                    if network != "default" && network != "none" {
                        return Err(Refused::StepNetwork(network));
                    }
                }
                if keyword.eq_ignore_ascii_case("ADD") {
                    let operands = &rest[flags.clone().count()..];
                    for source in add_sources(operands) {
                        let source = expand(&source, &args, &mut budget)?;
                        if is_remote(&source) {
                            fetched.push(source);
                        }
                    }
                }
                flags.filter_map(|flag| from_in_flag(flag)).collect()
            }
            _ => continue,
        };
        for image in named {
            let image = expand(unquote(&image), &args, &mut budget)?;
            if let Some(transport) = transport_of(&image) {
                return Err(Refused::LocalImage { image, transport });
            }
            if let Some(why) = foreign(&image) {
                return Err(Refused::OtherProject { image, why });
            }
        }
    }
    Ok(fetched)
}

/// `line` after `keyword` (any case) and the whitespace that follows it.
fn strip_keyword<'a>(line: &'a str, keyword: &str) -> Option<&'a str> {
    let head = line.get(..keyword.len())?;
    let rest = &line[keyword.len()..];
    (head.eq_ignore_ascii_case(keyword) && rest.starts_with(char::is_whitespace))
        .then(|| rest.trim_start())
}

/// The parser directives a Dockerfile opens with.
#[derive(Debug, Default)]
struct Directives {
    /// The line-continuation character (`\` unless `# escape=` says `` ` ``).
    escape: char,
    /// The `# syntax=` frontend image, if any.
    syntax: Option<String>,
}

/// Directives are `# key=value` comments before anything else; the first
/// other line (or a repeated key) ends them, as BuildKit reads them.
fn directives(text: &str) -> Directives {
    let mut d = Directives {
        escape: '\\',
        syntax: None,
    };
    let mut seen = std::collections::HashSet::new();
    for line in text.lines() {
        let Some(body) = line.trim().strip_prefix('#') else {
            break;
        };
        let Some((key, value)) = body.split_once('=') else {
            break;
        };
        let key = key.trim().to_ascii_lowercase();
        if key.contains(char::is_whitespace) || !seen.insert(key.clone()) {
            break;
        }
        let value = value.trim();
        match key.as_str() {
            "escape" if value == "`" => d.escape = '`',
            "syntax" => d.syntax = Some(value.to_owned()),
            _ => {}
        }
    }
    d
}

/// The network a `RUN` flag asks for: `--network=X`.
fn network_in_flag(flag: &str) -> Option<&str> {
    flag.strip_prefix("--network=")
}

/// An `ADD`'s sources: every operand but the last (the destination), in
/// either form (`ADD a b dst`, `ADD ["a", "b", "dst"]`).
fn add_sources(operands: &[&str]) -> Vec<String> {
    let joined = operands.join(" ");
    let words: Vec<String> = if joined.trim_start().starts_with('[') {
        serde_json::from_str(&joined).unwrap_or_default()
    } else {
        operands.iter().map(|w| unquote(w).to_owned()).collect()
    };
    match words.split_last() {
        Some((_, sources)) => sources.to_vec(),
        None => Vec::new(),
    }
}

/// Whether an `ADD` source is fetched from the network (a URL or a git
/// remote) rather than read from the context.
fn is_remote(source: &str) -> bool {
    let lower = source.to_ascii_lowercase();
    ["http://", "https://", "git://", "ssh://", "git@"]
        .iter()
        .any(|p| lower.starts_with(p))
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

/// The Dockerfile's instructions, one line each: continuations (by the
/// file's escape character) joined, comments and blank lines dropped.
fn instructions(text: &str, escape: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        if current.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        if let Some(head) = line.strip_suffix(escape) {
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
/// (an unset one is empty, as the builders take it), within bounds: one
/// value holds at most [`MAX_VALUE`] bytes, and `budget` (what every
/// expansion of the file may still produce) is spent as it goes.
fn expand(
    text: &str,
    args: &HashMap<String, String>,
    budget: &mut usize,
) -> Result<String, Refused> {
    let mut out = String::new();
    let mut rest = text;
    let mut push = |out: &mut String, piece: &str| -> Result<(), Refused> {
        if out.len() + piece.len() > MAX_VALUE {
            return Err(Refused::Expansion(format!(
                "expand past {MAX_VALUE} bytes in one value"
            )));
        }
        *budget = budget.checked_sub(piece.len()).ok_or_else(|| {
            Refused::Expansion(format!("expand past {MAX_EXPANDED} bytes in all"))
        })?;
        out.push_str(piece);
        Ok(())
    };
    while let Some(at) = rest.find('$') {
        push(&mut out, &rest[..at])?;
        let after = &rest[at + 1..];
        if let Some(body) = after.strip_prefix('{') {
            let Some(end) = body.find('}') else {
                push(&mut out, &rest[at..])?;
                return Ok(out);
            };
            let inner = &body[..end];
            let value = if let Some((name, default)) = inner.split_once(":-") {
                args.get(name)
                    .filter(|v| !v.is_empty())
                    .map_or(default, String::as_str)
            } else if let Some((name, alt)) = inner.split_once(":+") {
                if args.get(name).is_some_and(|v| !v.is_empty()) {
                    alt
                } else {
                    ""
                }
            } else {
                args.get(inner).map_or("", String::as_str)
            };
            push(&mut out, value)?;
            rest = &body[end + 1..];
        } else {
            let len = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            push(&mut out, args.get(&after[..len]).map_or("", String::as_str))?;
            rest = &after[len..];
        }
    }
    push(&mut out, rest)?;
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    fn local(dockerfile: &str) -> Option<(String, &'static str)> {
        match check(dockerfile, &BTreeMap::new(), false) {
            Ok(()) => None,
            Err(Refused::LocalImage { image, transport }) => Some((image, transport)),
            Err(other) => panic!("{other}"),
        }
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
            assert_eq!(local(ok), None, "{ok}");
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
            assert_eq!(local(bad).map(|(_, t)| t), Some(transport), "{bad}");
        }
    }

    #[test]
    fn a_build_arg_overrides_the_default_both_ways() {
        let df = "ARG BASE=alpine\nFROM $BASE\n";
        let evil = BTreeMap::from([("BASE".to_owned(), "sif:/x".to_owned())]);
        assert_eq!(
            check(df, &evil, false),
            Err(Refused::LocalImage {
                image: "sif:/x".to_owned(),
                transport: "sif"
            })
        );
        let df = "ARG BASE=dir:/x\nFROM $BASE\n";
        let fine = BTreeMap::from([("BASE".to_owned(), "alpine".to_owned())]);
        assert_eq!(check(df, &fine, false), Ok(()));
    }

    /// Issue 56.5: what slipped past the check before.
    #[test]
    fn escape_onbuild_and_frontends_do_not_slip_past() {
        for (bad, transport) in [
            // A backtick continues the line once `# escape=` says so.
            (
                "# escape=`\nFROM alpine\nCOPY `\n  --from=oci-archive:/x.tar /a /b\n",
                "oci-archive",
            ),
            ("FROM alpine\nONBUILD COPY --from=dir:/etc /e /e\n", "dir"),
            (
                "FROM alpine\nonbuild onbuild RUN --mount=from=sif:/x true\n",
                "sif",
            ),
        ] {
            assert_eq!(local(bad).map(|(_, t)| t), Some(transport), "{bad}");
        }
        let custom = "# syntax=docker.io/evil/frontend:1\nFROM alpine\n";
        assert_eq!(
            check(custom, &BTreeMap::new(), false),
            Err(Refused::Frontend("docker.io/evil/frontend:1".into()))
        );
        assert_eq!(
            check(custom, &BTreeMap::new(), true),
            Ok(()),
            "the operator allows it"
        );
        // A directive after the first instruction is a comment.
        assert_eq!(local("FROM alpine\n# syntax=x\n"), None);
    }

    /// Issue 56.6: every image the file names, after its ARG values, goes
    /// through the project check.
    #[test]
    fn every_named_image_goes_through_the_project_check() {
        let foreign = |image: &str| image.starts_with("reg:5000/b/").then(|| "B's".to_owned());
        for df in [
            "FROM reg:5000/b/app:1\n",
            "ARG P=b\nFROM reg:5000/$P/app:1\n",
            "FROM alpine\nCOPY --from=reg:5000/b/app:1 /x /y\n",
            "FROM alpine\nONBUILD RUN --mount=type=bind,from=reg:5000/b/app:1,target=/m true\n",
        ] {
            assert_eq!(
                check_with(df, &BTreeMap::new(), false, &foreign),
                Err(Refused::OtherProject {
                    image: "reg:5000/b/app:1".into(),
                    why: "B's".into()
                }),
                "{df}"
            );
        }
        assert_eq!(
            check_with("FROM reg:5000/a/app:1\n", &BTreeMap::new(), false, &foreign),
            Ok(Vec::new())
        );
    }

    /// Issue 56.4: nine 300-byte ARG lines that double each other asked
    /// for a 64 GiB string; the expansion stops at its bounds.
    #[test]
    fn arg_expansion_is_bounded() {
        let mut df = format!("ARG A0={}\n", "x".repeat(300));
        for i in 1..40 {
            let prev = i - 1;
            writeln!(df, "ARG A{i}=${{A{prev}}}${{A{prev}}}").unwrap();
        }
        df.push_str("FROM alpine:$A39\n");
        let started = std::time::Instant::now();
        let err = check(&df, &BTreeMap::new(), false).unwrap_err();
        assert!(matches!(err, Refused::Expansion(_)), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        // Many modest values stop at the total.
        let mut wide = String::new();
        for i in 0..200 {
            writeln!(wide, "ARG B{i}={}", "y".repeat(30_000)).unwrap();
        }
        let err = check(&(wide + "FROM alpine\n"), &BTreeMap::new(), false).unwrap_err();
        assert!(err.to_string().contains("in all"), "{err}");
    }

    /// 56.2 (defence in depth; the namespace is the real fix): a step asks
    /// for the host's network; `ADD` sources that are fetched are returned
    /// for the caller to vet, expanded, in both forms, triggers included.
    #[test]
    fn host_network_steps_are_refused_and_add_urls_are_returned() {
        let none = BTreeMap::new();
        for df in [
            "FROM a\nRUN --network=host curl http://127.0.0.1/\n",
            "FROM a\nARG N=host\nRUN --mount=type=cache,target=/c --network=$N true\n",
            "FROM a\nONBUILD RUN --network=host true\n",
        ] {
            assert_eq!(
                check(df, &none, false),
                Err(Refused::StepNetwork("host".into())),
                "{df}"
            );
        }
        for df in [
            "FROM a\nRUN --network=none true\n",
            "FROM a\nRUN --network=default true\n",
        ] {
            assert_eq!(check(df, &none, false), Ok(()), "{df}");
        }
        let df = "FROM a\nARG H=127.0.0.1:9100\nADD http://$H/metrics /m\n\
                  ADD --chmod=644 [\"https://example.com/x\", \"local.txt\", \"/dst/\"]\n\
                  ADD ctx.txt /ctx\nONBUILD ADD git@example.com:o/r.git /src\n";
        assert_eq!(
            check_with(df, &none, false, &|_| None).unwrap(),
            [
                "http://127.0.0.1:9100/metrics",
                "https://example.com/x",
                "git@example.com:o/r.git"
            ]
        );
    }
}
