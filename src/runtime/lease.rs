//! Leases protect content and snapshots that nothing references yet from
//! containerd's garbage collector. Each carries an expiry label, so the
//! lease of an agent killed mid-import expires by itself.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::{AddResourceRequest, CreateRequest, DeleteRequest, Resource};

use super::connection::Containerd;
use super::error::{RuntimeError, ignore_not_found};

const EXPIRE_LABEL: &str = "containerd.io/gc.expire";

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

#[derive(Debug)]
pub struct Lease {
    id: String,
}

impl Lease {
    /// Creates a lease that containerd drops by itself after `ttl`.
    pub async fn create(
        ctd: &Containerd,
        purpose: &str,
        ttl: Duration,
    ) -> Result<Self, RuntimeError> {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let id = format!("zattera-{purpose}-{nanos}-{}", std::process::id());
        let expire = rfc3339(SystemTime::now() + ttl);
        let labels = HashMap::from([(EXPIRE_LABEL.to_owned(), expire)]);
        ctd.leases()
            .create(ctd.request(CreateRequest {
                id: id.clone(),
                labels,
            }))
            .await
            .map_err(RuntimeError::grpc(format!("create lease {id}")))?;
        Ok(Self { id })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Adds something that already exists (content found in the store, a
    /// snapshot unpacked earlier) so it cannot vanish before it is referenced.
    pub async fn hold(&self, ctd: &Containerd, kind: &str, id: &str) -> Result<(), RuntimeError> {
        ctd.leases()
            .add_resource(ctd.request(AddResourceRequest {
                id: self.id.clone(),
                resource: Some(Resource {
                    id: id.to_owned(),
                    r#type: kind.to_owned(),
                }),
            }))
            .await
            .map_err(RuntimeError::grpc(format!(
                "hold {kind} {id} in lease {}",
                self.id
            )))?;
        Ok(())
    }

    /// Releases the lease once records reference what it protected.
    pub async fn release(self, ctd: &Containerd) -> Result<(), RuntimeError> {
        ignore_not_found(
            ctd.leases()
                .delete(ctd.request(DeleteRequest {
                    id: self.id.clone(),
                    sync: false,
                }))
                .await,
        )
        .map_err(RuntimeError::grpc(format!("delete lease {}", self.id)))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn expiry_label_is_rfc3339_utc() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_026_645);
        assert_eq!(rfc3339(t), "2026-11-30T08:17:25Z");
    }
}
