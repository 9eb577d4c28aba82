//! What the running agent says, through its admin socket
//! (`<run dir>/agent.sock`): which containers are live, and which container
//! an assignment id or `app.env.project` names. Without an agent, the CLI
//! falls back to what the kernel shows.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Instance {
    pub id: String,
    #[serde(default)]
    pub project: String,
    #[serde(default)]
    pub app: String,
    #[serde(default)]
    pub environment: String,
    #[serde(default)]
    pub container_id: String,
}

#[derive(Debug, Deserialize)]
struct Status {
    assignments: Vec<Instance>,
}

/// The agent's instances, or `None` when no agent answers at `run_dir`.
pub fn instances(run_dir: &Path) -> Option<Vec<Instance>> {
    let mut stream = UnixStream::connect(run_dir.join("agent.sock")).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream.write_all(b"status\n").ok()?;
    let mut body = Vec::new();
    stream.read_to_end(&mut body).ok()?;
    serde_json::from_slice::<Status>(&body)
        .ok()
        .map(|s| s.assignments)
}

/// The container id a TARGET names ([`zattera_netns::target`]).
pub fn resolve(instances: &[Instance], target: &str) -> Result<String, String> {
    let named: Vec<zattera_netns::target::Named<'_>> = instances
        .iter()
        .map(|i| zattera_netns::target::Named {
            id: &i.id,
            project: &i.project,
            app: &i.app,
            environment: &i.environment,
            container_id: &i.container_id,
        })
        .collect();
    zattera_netns::target::resolve(&named, target).map(|n| instances[n].container_id.clone())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn inst(id: &str, app: &str, cid: &str) -> Instance {
        Instance {
            id: id.into(),
            project: "demo".into(),
            app: app.into(),
            environment: "prod".into(),
            container_id: cid.into(),
        }
    }

    #[test]
    fn resolves_ids_names_and_containers() {
        let all = vec![
            inst("demo-web-1", "web", "c-web-1"),
            inst("demo-web-0", "web", "c-web-0"),
            inst("demo-db-0", "db", "c-db"),
        ];
        assert_eq!(resolve(&all, "demo-db-0").unwrap(), "c-db");
        assert_eq!(
            resolve(&all, "web.prod.demo").unwrap(),
            "c-web-0",
            "first instance by id"
        );
        assert_eq!(resolve(&all, "c-web-1").unwrap(), "c-web-1");
        let err = resolve(&all, "nope.prod.demo").unwrap_err();
        assert!(
            err.contains("nope.prod.demo") && err.contains("demo-db-0 (db.prod.demo)"),
            "{err}"
        );
    }
}
