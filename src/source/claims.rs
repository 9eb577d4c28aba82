//! What manifest files claim that only one of them may have: an app of a
//! project, an assignment id, a fixed host port. Each claim records the file
//! that holds it, so a file can be checked against everyone but itself (an
//! edit of a file never conflicts with that file's previous version).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::assign::assignment_id;
use super::keypath::render_key;
use super::manifest::AppManifest;

#[derive(Debug, Default)]
pub(super) struct Claims {
    apps: BTreeMap<(String, String), PathBuf>,
    ids: BTreeMap<String, PathBuf>,
    /// (transport, port) → the file and the key that asked for it.
    host_ports: BTreeMap<(&'static str, u16), (PathBuf, String)>,
}

impl Claims {
    /// Whether `m` from `file` fits with what the other files hold; if not,
    /// the message names both files.
    pub fn check(&self, m: &AppManifest, file: &Path) -> Result<(), String> {
        let here = file.display();
        let app = (m.project.to_string(), m.app.to_string());
        if let Some(other) = self.apps.get(&app).filter(|o| *o != file) {
            return Err(format!(
                "{here}: app.name: app {:?} of project {:?} is already defined in {}",
                app.1,
                app.0,
                other.display()
            ));
        }
        for (env, spec) in &m.envs {
            let at = format!("env.{}", render_key(env.as_str()));
            for index in 0..spec.replicas {
                let id = assignment_id(&m.project, &m.app, env, index);
                if let Some(other) = self.ids.get(&id).filter(|o| *o != file) {
                    return Err(format!(
                        "{here}: {at}: assignment id {id:?} is also produced by {} \
                         (project, app and environment names joined by '-' collide); rename one",
                        other.display()
                    ));
                }
            }
            if spec.replicas == 0 {
                continue;
            }
            for (i, p) in spec.ports.iter().enumerate() {
                let Some(h) = p.host_port else { continue };
                if let Some((other, key)) = self
                    .host_ports
                    .get(&(p.protocol.transport(), h))
                    .filter(|(o, _)| o != file)
                {
                    return Err(format!(
                        "{here}: {at}.ports[{i}].host_port: host port {h}/{} is already requested by {} ({key})",
                        p.protocol.transport(),
                        other.display()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Gives `file` the claims of `m`, in place of whatever it held.
    pub fn register(&mut self, m: &AppManifest, file: &Path) {
        self.release(file);
        self.apps
            .insert((m.project.to_string(), m.app.to_string()), file.to_owned());
        for (env, spec) in &m.envs {
            let at = format!("env.{}", render_key(env.as_str()));
            for index in 0..spec.replicas {
                self.ids.insert(
                    assignment_id(&m.project, &m.app, env, index),
                    file.to_owned(),
                );
            }
            if spec.replicas == 0 {
                continue;
            }
            for (i, p) in spec.ports.iter().enumerate() {
                if let Some(h) = p.host_port {
                    self.host_ports.insert(
                        (p.protocol.transport(), h),
                        (file.to_owned(), format!("{at}.ports[{i}].host_port")),
                    );
                }
            }
        }
    }

    /// Drops every claim of `file`.
    pub fn release(&mut self, file: &Path) {
        self.apps.retain(|_, f| f != file);
        self.ids.retain(|_, f| f != file);
        self.host_ports.retain(|_, (f, _)| f != file);
    }
}
