//! The name table: which internal names exist, in which scope, and their
//! addresses. A table is immutable once built; the server swaps whole tables
//! (see [`crate::DnsServer::set_table`]), so a query never waits on an update.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tracing::debug;

use crate::name::{InternalName, NameClass, Scope};

/// One `InternalService` of a route snapshot (wire.md appendix B), reduced
/// to what DNS needs. The agent converts its generated proto type into this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteService {
    /// `<app>.<env>.<project>.internal.` (trailing dot optional).
    pub fqdn: String,
    pub project_id: String,
    /// Kept for the record; the scope uses the environment *name* from the
    /// FQDN (D-7), because environment ids are per app.
    pub environment_id: String,
    /// The VIP DNS answers with; empty or not IPv4 means NXDOMAIN.
    pub vip: String,
}

/// One healthy local instance, for standalone mode (no route snapshot).
/// The caller passes only healthy instances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalInstance {
    pub project_id: String,
    /// The project label of the full name; the project id when no name is
    /// known, as control does for FQDNs.
    pub project_name: String,
    pub environment: String,
    pub app: String,
    pub ip: Ipv4Addr,
}

/// The addresses of one name and the turn counter that rotates them.
#[derive(Debug)]
pub(crate) struct Entry {
    scope: Scope,
    addrs: Box<[Ipv4Addr]>,
    turn: AtomicUsize,
}

impl Entry {
    /// How many addresses the name has.
    pub(crate) fn len(&self) -> usize {
        self.addrs.len()
    }

    /// The addresses, starting one further along at every call, so clients
    /// that take the first A record spread over the instances.
    pub(crate) fn rotated(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        let len = self.addrs.len().max(1);
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % len;
        self.addrs
            .iter()
            .cycle()
            .skip(start)
            .take(self.addrs.len())
            .copied()
    }
}

/// An immutable snapshot of every internal name this node answers.
#[derive(Debug, Default)]
pub struct NameTable {
    /// `<app>.internal`: scope (normalised) -> app -> entry.
    short: HashMap<Scope, HashMap<String, Arc<Entry>, Hasher>, Hasher>,
    /// `<app>.<env>.<project>.internal` (lower case, no trailing dot).
    full: HashMap<String, Arc<Entry>, Hasher>,
}

/// Every lookup hashes a scope and a name: see the crate's manifest.
type Hasher = foldhash::fast::RandomState;

impl NameTable {
    /// The table before the first snapshot: every internal name is NXDOMAIN.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Builds the table from a route snapshot's internal services. The scope
    /// of each service is (project id, environment name from its FQDN).
    pub fn from_routes<'a>(services: impl IntoIterator<Item = &'a RouteService>) -> Self {
        let mut builder = Builder::default();
        for service in services {
            let Some([app, environment, project]) = fqdn_labels(&service.fqdn) else {
                debug!(fqdn = %service.fqdn, "route service with a malformed fqdn skipped");
                continue;
            };
            let Ok(vip) = service.vip.parse::<Ipv4Addr>() else {
                // D-3: found with an empty VIP answers NXDOMAIN, as if absent.
                debug!(fqdn = %service.fqdn, vip = %service.vip, "route service without an IPv4 VIP skipped");
                continue;
            };
            let scope = Scope::new(service.project_id.clone(), environment.clone());
            builder.add(&scope, &app, &environment, &project, vip);
        }
        builder.finish()
    }

    /// Builds the table from the healthy local instances (standalone): every
    /// instance's IP becomes one A record of its app's names.
    pub fn from_instances<'a>(instances: impl IntoIterator<Item = &'a LocalInstance>) -> Self {
        let mut builder = Builder::default();
        for i in instances {
            let scope = Scope::new(i.project_id.clone(), i.environment.clone());
            builder.add(&scope, &i.app, &i.environment, &i.project_name, i.ip);
        }
        builder.finish()
    }

    /// Number of distinct names (each answerable in two forms).
    pub fn len(&self) -> usize {
        self.full.len()
    }

    pub fn is_empty(&self) -> bool {
        self.full.is_empty()
    }

    /// The addresses `name` has for a client of `scope` (already
    /// normalised), or `None`: unknown, or another scope's name.
    pub(crate) fn lookup(&self, name: &InternalName, scope: &Scope) -> Option<&Entry> {
        let entry = match name {
            InternalName::Short { app } => self.short.get(scope)?.get(app.as_str())?,
            InternalName::Qualified {
                app,
                environment,
                project,
            } => self.full.get(&format!("{app}.{environment}.{project}"))?,
        };
        (entry.scope == *scope).then_some(entry.as_ref())
    }
}

/// Splits `<app>.<env>.<project>.internal[.]` into its three lower-case
/// labels; `None` for any other form.
fn fqdn_labels(fqdn: &str) -> Option<[String; 3]> {
    match InternalName::parse(fqdn) {
        NameClass::Internal(InternalName::Qualified {
            app,
            environment,
            project,
        }) => Some([app, environment, project]),
        _ => None,
    }
}

/// Collects addresses per full name, then freezes them into entries.
#[derive(Default)]
struct Builder {
    /// full name -> (scope, addresses), in first-seen order.
    names: HashMap<String, (Scope, Vec<Ipv4Addr>)>,
    order: Vec<String>,
}

impl Builder {
    fn add(&mut self, scope: &Scope, app: &str, environment: &str, project: &str, ip: Ipv4Addr) {
        let app = app.to_ascii_lowercase();
        let key = format!(
            "{app}.{}.{}",
            environment.to_ascii_lowercase(),
            project.to_ascii_lowercase()
        );
        let scope = scope.normalized();
        match self.names.get_mut(&key) {
            // The first owner of a name keeps it; a second project claiming
            // the same label would be a control-plane bug, not ours to fix.
            Some((owner, addrs)) if *owner == scope => {
                if !addrs.contains(&ip) {
                    addrs.push(ip);
                }
            }
            Some(_) => debug!(name = %key, "name claimed by two scopes; first kept"),
            None => {
                self.order.push(key.clone());
                self.names.insert(key, (scope, vec![ip]));
            }
        }
    }

    fn finish(mut self) -> NameTable {
        let mut table = NameTable::default();
        for key in self.order {
            let Some((scope, mut addrs)) = self.names.remove(&key) else {
                continue;
            };
            addrs.sort_unstable();
            let app = key.split('.').next().unwrap_or_default().to_owned();
            let entry = Arc::new(Entry {
                scope: scope.clone(),
                addrs: addrs.into_boxed_slice(),
                turn: AtomicUsize::new(0),
            });
            table
                .short
                .entry(scope)
                .or_default()
                .entry(app)
                .or_insert_with(|| Arc::clone(&entry));
            table.full.insert(key, entry);
        }
        table
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn svc(fqdn: &str, project: &str, vip: &str) -> RouteService {
        RouteService {
            fqdn: fqdn.into(),
            project_id: project.into(),
            environment_id: "env-id".into(),
            vip: vip.into(),
        }
    }

    fn short(app: &str) -> InternalName {
        InternalName::Short { app: app.into() }
    }

    fn full(name: &str) -> InternalName {
        match InternalName::parse(name) {
            NameClass::Internal(n) => n,
            other => panic!("{name}: {other:?}"),
        }
    }

    fn addrs(e: Option<&Entry>) -> Vec<Ipv4Addr> {
        e.map(|e| e.addrs.to_vec()).unwrap_or_default()
    }

    #[test]
    fn routes_resolve_in_their_scope_only() {
        let t = NameTable::from_routes(&[
            svc("db.production.shop.internal.", "p1", "10.97.0.5"),
            svc("db.staging.shop.internal.", "p1", "10.97.0.6"),
            svc("api.production.shop.internal.", "p1", ""),
        ]);
        let prod = Scope::new("p1", "production");
        let staging = Scope::new("p1", "staging");
        let vip5 = vec![Ipv4Addr::new(10, 97, 0, 5)];
        assert_eq!(addrs(t.lookup(&short("db"), &prod)), vip5);
        assert_eq!(
            addrs(t.lookup(&full("DB.Production.shop.internal"), &prod)),
            vip5
        );
        assert_eq!(
            addrs(t.lookup(&short("db"), &staging)),
            vec![Ipv4Addr::new(10, 97, 0, 6)]
        );
        // Another environment's full name, asked from production: not found.
        assert!(t.lookup(&full("db.staging.shop.internal"), &prod).is_none());
        // Another project with the same labels: not found.
        assert!(
            t.lookup(&short("db"), &Scope::new("p2", "production"))
                .is_none()
        );
        // An empty VIP is as good as absent.
        assert!(t.lookup(&short("api"), &prod).is_none());
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn malformed_fqdns_are_skipped() {
        let t = NameTable::from_routes(&[
            svc("db.shop.internal.", "p1", "10.97.0.5"),
            svc("db.production.shop.example.", "p1", "10.97.0.5"),
        ]);
        assert!(t.is_empty());
    }

    #[test]
    fn instances_group_per_app_and_rotate() {
        let inst = |app: &str, ip: [u8; 4]| LocalInstance {
            project_id: "p1".into(),
            project_name: "shop".into(),
            environment: "Production".into(),
            app: app.into(),
            ip: Ipv4Addr::from(ip),
        };
        let t = NameTable::from_instances(&[
            inst("web", [10, 201, 0, 3]),
            inst("web", [10, 201, 0, 2]),
            inst("web", [10, 201, 0, 2]),
            inst("db", [10, 201, 0, 9]),
        ]);
        let scope = Scope::new("p1", "production");
        let e = t.lookup(&short("web"), &scope).unwrap();
        let first: Vec<_> = e.rotated().collect();
        let second: Vec<_> = e.rotated().collect();
        let third: Vec<_> = e.rotated().collect();
        assert_eq!(first.len(), 2);
        assert_eq!(first[0], second[1]);
        assert_eq!(first[1], second[0]);
        assert_eq!(first, third);
        assert_eq!(
            addrs(t.lookup(&full("db.production.shop.internal"), &scope)),
            vec![Ipv4Addr::new(10, 201, 0, 9)]
        );
    }
}
