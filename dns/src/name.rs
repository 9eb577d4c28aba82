//! Internal names and the scope a listener answers for (runtime.md §8, D-7).

/// The (project, environment) a gateway's listener serves.
///
/// Following the recommended reading of D-7, `project` is the project **id**
/// and `environment` the environment **name** (`production`, `staging`): two
/// apps of one project and environment name share a scope even though each
/// has its own environment id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub project: String,
    pub environment: String,
}

impl Scope {
    pub fn new(project: impl Into<String>, environment: impl Into<String>) -> Self {
        Self {
            project: project.into(),
            environment: environment.into(),
        }
    }

    /// The form used as a table key: environment names are DNS labels, so
    /// they compare without case; project ids are opaque and kept as given.
    pub(crate) fn normalized(&self) -> Self {
        Self {
            project: self.project.clone(),
            environment: self.environment.to_ascii_lowercase(),
        }
    }
}

/// A query name under `.internal`, split into its parts (lower case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InternalName {
    /// `<app>.internal`: the app in the asker's own scope.
    Short { app: String },
    /// `<app>.<env>.<project>.internal`.
    Qualified {
        app: String,
        environment: String,
        project: String,
    },
}

/// Where a query name belongs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameClass {
    /// Not under `.internal`: relayed upstream.
    External,
    /// Under `.internal` and well formed.
    Internal(InternalName),
    /// Under `.internal` but of no form we answer (`internal` alone, three
    /// labels, five or more, odd bytes): NXDOMAIN.
    Invalid,
}

impl InternalName {
    /// Classifies a dotted name (case-insensitive, trailing dot optional).
    pub fn parse(qname: &str) -> NameClass {
        let trimmed = qname.trim_end_matches('.');
        if trimmed.is_empty() {
            return NameClass::External;
        }
        Self::from_labels(trimmed.split('.').map(str::as_bytes))
    }

    /// Classifies a name given as its wire labels (root label excluded).
    /// Working on labels, not a dotted string, keeps a label that itself
    /// contains a dot from passing for two labels.
    pub fn from_labels<'a>(labels: impl IntoIterator<Item = &'a [u8]>) -> NameClass {
        // The forms answered have one or three labels before `internal`:
        // those are kept (on the stack: this runs for every query), the
        // rest only counted.
        let mut first: [&[u8]; 3] = [&[]; 3];
        let mut last: Option<&[u8]> = None;
        let mut count = 0usize;
        for label in labels {
            if let Some(previous) = last
                && let Some(slot) = first.get_mut(count - 1)
            {
                *slot = previous;
            }
            last = Some(label);
            count += 1;
        }
        if !last.is_some_and(|l| l.eq_ignore_ascii_case(b"internal")) {
            return NameClass::External;
        }
        let lower = |label: &[u8]| match std::str::from_utf8(label) {
            Ok(text) if !text.is_empty() && !text.contains('.') => Some(text.to_ascii_lowercase()),
            _ => None,
        };
        let name = match (count - 1, first) {
            (1, [app, _, _]) => lower(app).map(|app| Self::Short { app }),
            (3, [app, environment, project]) => lower(app)
                .zip(lower(environment))
                .zip(lower(project))
                .map(|((app, environment), project)| Self::Qualified {
                    app,
                    environment,
                    project,
                }),
            _ => None,
        };
        name.map_or(NameClass::Invalid, NameClass::Internal)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn short_and_qualified_names_are_split_in_lower_case() {
        assert_eq!(
            InternalName::parse("Web.Internal."),
            NameClass::Internal(InternalName::Short { app: "web".into() })
        );
        assert_eq!(
            InternalName::parse("web.Production.demo.INTERNAL"),
            NameClass::Internal(InternalName::Qualified {
                app: "web".into(),
                environment: "production".into(),
                project: "demo".into(),
            })
        );
    }

    #[test]
    fn non_internal_names_go_upstream_and_odd_internal_ones_are_invalid() {
        assert_eq!(InternalName::parse("example.com"), NameClass::External);
        assert_eq!(
            InternalName::parse("internal.example.com"),
            NameClass::External
        );
        assert_eq!(InternalName::parse("."), NameClass::External);
        assert_eq!(InternalName::parse("a.b.internal"), NameClass::Invalid);
        assert_eq!(InternalName::parse("internal"), NameClass::Invalid);
        assert_eq!(InternalName::parse("a.b.c.d.internal"), NameClass::Invalid);
    }

    #[test]
    fn a_label_holding_a_dot_or_bad_utf8_is_invalid() {
        let labels: [&[u8]; 2] = [b"we.b", b"internal"];
        assert_eq!(InternalName::from_labels(labels), NameClass::Invalid);
        let labels: [&[u8]; 2] = [b"\xff", b"internal"];
        assert_eq!(InternalName::from_labels(labels), NameClass::Invalid);
    }

    #[test]
    fn scope_normalisation_lowers_only_the_environment() {
        let s = Scope::new("Proj-ID", "Production").normalized();
        assert_eq!(s, Scope::new("Proj-ID", "production"));
    }
}
