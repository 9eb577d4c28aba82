//! Fetching a manifest or an index with its size capped while it is read
//! (45.3). oci-client reads a manifest body whole whatever its length, so a
//! registry (or anything posing as one) could make one pull hold gigabytes;
//! here oci-client only does the token dance, and the GET is ours.

use bytes::Bytes;
use oci_client::errors::OciDistributionError;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};

/// The most a manifest or an index may be: real ones are a few KiB, and
/// containerd's own fetcher stops at 4 MiB too.
pub const MAX_MANIFEST: u64 = 4 << 20;

/// Why a manifest could not be fetched: the text a pull failure carries.
pub type FetchError = String;

/// The plain HTTP client manifests are fetched with, beside oci-client's.
#[derive(Debug, Clone)]
pub struct ManifestGet {
    http: reqwest::Client,
    scheme: &'static str,
}

impl ManifestGet {
    /// A client for one registry: `plain_http` for a dev registry on
    /// loopback, `ca_pem` trusted besides the system roots.
    pub fn new(plain_http: bool, ca_pem: Option<&[u8]>) -> Result<Self, FetchError> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .read_timeout(std::time::Duration::from_secs(60))
            .redirect(reqwest::redirect::Policy::limited(5));
        if let Some(pem) = ca_pem {
            let ca = reqwest::Certificate::from_pem(pem).map_err(|e| format!("cluster CA: {e}"))?;
            builder = builder.add_root_certificate(ca);
        }
        Ok(Self {
            http: builder.build().map_err(|e| format!("http client: {e}"))?,
            scheme: if plain_http { "http" } else { "https" },
        })
    }

    /// The manifest `target` names (by tag or digest), accepting `accept`,
    /// at most [`MAX_MANIFEST`] bytes. `oci` authenticates: a bearer token
    /// from the registry's challenge, or the basic credential as given.
    pub async fn get(
        &self,
        oci: &Client,
        target: &Reference,
        auth: &RegistryAuth,
        accept: &[&str],
    ) -> Result<Bytes, FetchError> {
        let token = oci
            .auth(target, auth, RegistryOperation::Pull)
            .await
            .map_err(|e| describe(&e))?;
        let reference = target.digest().or_else(|| target.tag()).unwrap_or("latest");
        let url = format!(
            "{}://{}/v2/{}/manifests/{reference}",
            self.scheme,
            target.resolve_registry(),
            target.repository()
        );
        let mut request = self
            .http
            .get(&url)
            .header(reqwest::header::ACCEPT, accept.join(", "));
        request = match (token, auth) {
            (Some(token), _) => request.bearer_auth(token),
            (None, RegistryAuth::Basic(user, password)) => request.basic_auth(user, Some(password)),
            (None, _) => request,
        };
        let mut response = request.send().await.map_err(|e| chain(&e))?;
        let status = response.status();
        if status == reqwest::StatusCode::UNAUTHORIZED {
            return Err(format!("registry answered 401 Unauthorized at {url}"));
        }
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(format!("not found in the registry: {url}"));
        }
        if !status.is_success() {
            return Err(format!("registry answered {status} at {url}"));
        }
        let too_large = || format!("manifest at {url} is larger than {MAX_MANIFEST} bytes");
        if response.content_length().is_some_and(|n| n > MAX_MANIFEST) {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| chain(&e))? {
            if (body.len() + chunk.len()) as u64 > MAX_MANIFEST {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(body))
    }
}

/// An error with its causes, as the pull's other messages have them.
fn chain(e: &reqwest::Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg = format!("{msg}: {s}");
        source = s.source();
    }
    msg
}

/// A registry error as a pull failure says it.
pub fn describe(e: &OciDistributionError) -> String {
    match e {
        OciDistributionError::AuthenticationFailure(m) => {
            format!("registry refused the credentials: {m}")
        }
        OciDistributionError::UnauthorizedError { url } => {
            format!("registry answered 401 Unauthorized at {url}")
        }
        OciDistributionError::ImageManifestNotFoundError(m) => {
            format!("not found in the registry: {m}")
        }
        OciDistributionError::RequestError(r) => {
            let mut msg = r.to_string();
            let mut source = std::error::Error::source(r);
            while let Some(s) = source {
                msg = format!("{msg}: {s}");
                source = s.source();
            }
            msg
        }
        other => other.to_string(),
    }
}
