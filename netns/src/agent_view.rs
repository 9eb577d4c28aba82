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

/// The container id a TARGET names: an assignment id, `app.env.project`
/// (its first instance) or a container id. `Err` lists what exists.
pub fn resolve(instances: &[Instance], target: &str) -> Result<String, String> {
    let with_container = || instances.iter().filter(|i| !i.container_id.is_empty());
    if let Some(i) = with_container().find(|i| i.id == target || i.container_id == target) {
        return Ok(i.container_id.clone());
    }
    if let [app, env, project] = target.split('.').collect::<Vec<_>>()[..] {
        let mut matching: Vec<&Instance> = with_container()
            .filter(|i| i.app == app && i.environment == env && i.project == project)
            .collect();
        matching.sort_by(|a, b| a.id.cmp(&b.id));
        if let Some(first) = matching.first() {
            return Ok(first.container_id.clone());
        }
    }
    let known: Vec<String> = with_container()
        .map(|i| format!("{} ({}.{}.{})", i.id, i.app, i.environment, i.project))
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
