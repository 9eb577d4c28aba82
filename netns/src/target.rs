//! TARGET, as every CLI of the agent takes it: an assignment id, a
//! containerd container id, or `app.env.project` (its first instance by
//! id). Only instances with a container can be named.

/// What naming needs of one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Named<'a> {
    pub id: &'a str,
    pub project: &'a str,
    pub app: &'a str,
    pub environment: &'a str,
    pub container_id: &'a str,
}

/// The index in `all` of the instance `target` names; the error lists what
/// runs.
pub fn resolve(all: &[Named<'_>], target: &str) -> Result<usize, String> {
    let with_container = || {
        all.iter()
            .enumerate()
            .filter(|(_, i)| !i.container_id.is_empty())
    };
    if let Some((n, _)) = with_container().find(|(_, i)| i.id == target || i.container_id == target)
    {
        return Ok(n);
    }
    if let [app, env, project] = target.split('.').collect::<Vec<_>>()[..] {
        let first = with_container()
            .filter(|(_, i)| i.app == app && i.environment == env && i.project == project)
            .min_by(|(_, a), (_, b)| a.id.cmp(b.id));
        if let Some((n, _)) = first {
            return Ok(n);
        }
    }
    let known: Vec<String> = with_container()
        .map(|(_, i)| format!("{} ({}.{}.{})", i.id, i.app, i.environment, i.project))
        .collect();
    Err(format!(
        "no instance {target:?}; the agent runs: {}",
        if known.is_empty() {
            "nothing".to_owned()
        } else {
            known.join(", ")
        }
    ))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn named<'a>(id: &'a str, app: &'a str, cid: &'a str) -> Named<'a> {
        Named {
            id,
            project: "demo",
            app,
            environment: "prod",
            container_id: cid,
        }
    }

    #[test]
    fn resolves_ids_names_and_containers() {
        let all = [
            named("demo-web-1", "web", "c-web-1"),
            named("demo-web-0", "web", "c-web-0"),
            named("demo-db-0", "db", "c-db"),
            named("demo-db-1", "db", ""),
        ];
        assert_eq!(resolve(&all, "demo-db-0"), Ok(2));
        assert_eq!(
            resolve(&all, "web.prod.demo"),
            Ok(1),
            "first instance by id"
        );
        assert_eq!(resolve(&all, "c-web-1"), Ok(0));
        assert!(resolve(&all, "demo-db-1").is_err(), "no container");
        let err = resolve(&all, "nope.prod.demo").unwrap_err();
        assert!(
            err.contains("nope.prod.demo") && err.contains("demo-db-0 (db.prod.demo)"),
            "{err}"
        );
    }
}
