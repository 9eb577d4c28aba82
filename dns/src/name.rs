//! Internal names and the scope a listener answers for (runtime.md §8, D-7).

/// The (project, environment) a gateway's listener serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub project: String,
    pub environment: String,
}

/// A query name under `.internal`, split into its parts.
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

impl InternalName {
    /// Parses a query name (case-insensitive, trailing dot optional). `None`
    /// means the name is not internal and goes upstream; `Some(Err)` means
    /// it is under `.internal` but has no meaning here (NXDOMAIN).
    pub fn parse(qname: &str) -> Option<Result<Self, ()>> {
        let lower = qname.trim_end_matches('.').to_ascii_lowercase();
        let rest = lower
            .strip_suffix(".internal")
            .or_else(|| (lower == "internal").then_some(""))?;
        let labels: Vec<&str> = if rest.is_empty() {
            vec![]
        } else {
            rest.split('.').collect()
        };
        Some(match labels.as_slice() {
            [app] => Ok(Self::Short {
                app: (*app).to_owned(),
            }),
            [app, env, project] => Ok(Self::Qualified {
                app: (*app).to_owned(),
                environment: (*env).to_owned(),
                project: (*project).to_owned(),
            }),
            _ => Err(()),
        })
    }

    /// The app this name means, if it may be answered inside `scope`.
    pub fn app_in(&self, scope: &Scope) -> Option<&str> {
        match self {
            Self::Short { app } => Some(app),
            Self::Qualified {
                app,
                environment,
                project,
            } if environment.eq_ignore_ascii_case(&scope.environment)
                && project.eq_ignore_ascii_case(&scope.project) =>
            {
                Some(app)
            }
            Self::Qualified { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope() -> Scope {
        Scope {
            project: "demo".into(),
            environment: "production".into(),
        }
    }

    #[test]
    fn short_and_qualified_names_resolve_in_scope() {
        let short = InternalName::parse("Web.Internal.").unwrap().unwrap();
        assert_eq!(short.app_in(&scope()), Some("web"));
        let q = InternalName::parse("web.production.demo.internal")
            .unwrap()
            .unwrap();
        assert_eq!(q.app_in(&scope()), Some("web"));
    }

    #[test]
    fn other_scopes_are_not_answered() {
        let q = InternalName::parse("web.staging.demo.internal")
            .unwrap()
            .unwrap();
        assert_eq!(q.app_in(&scope()), None);
        let q = InternalName::parse("web.production.other.internal")
            .unwrap()
            .unwrap();
        assert_eq!(q.app_in(&scope()), None);
    }

    #[test]
    fn non_internal_names_go_upstream_and_odd_internal_ones_are_nxdomain() {
        assert!(InternalName::parse("example.com").is_none());
        assert!(InternalName::parse("internal.example.com").is_none());
        assert_eq!(InternalName::parse("a.b.internal"), Some(Err(())));
        assert_eq!(InternalName::parse("internal"), Some(Err(())));
    }
}
