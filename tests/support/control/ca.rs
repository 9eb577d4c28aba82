//! The cluster CA a test control plane signs with.

use super::*;

/// A cluster CA made for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
    pub der: Vec<u8>,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            der: cert.der().to_vec(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The join token's CA pin.
    pub fn pin(&self) -> String {
        tls::pin_of(&self.der)
    }

    /// A join token for `secret` pinned to this CA.
    pub fn token(&self, secret: &str) -> String {
        format!("K10{}::{secret}", self.pin())
    }

    /// The control API's certificate (IP SAN 127.0.0.1) and key, the chain
    /// as control sends it: leaf + root.
    pub fn server_identity(&self) -> (String, String) {
        self.server_identity_for(&["127.0.0.1"])
    }

    /// [`Self::server_identity`] with the IP SANs `ips` (a control node
    /// carries its mesh IP).
    pub fn server_identity_for(&self, ips: &[&str]) -> (String, String) {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let names: Vec<String> = std::iter::once("localhost")
            .chain(ips.iter().copied())
            .map(str::to_owned)
            .collect();
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "zattera-control");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (format!("{}{}", cert.pem(), self.pem), key.serialize_pem())
    }

    /// Params control imposes on a node certificate (wire.md §8), valid
    /// from 5 minutes ago for `valid_for` (negative: already expired).
    fn node_params(node_id: &str, expired: bool) -> CertificateParams {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("node-{node_id}"));
        params.subject_alt_names = vec![
            SanType::URI(format!("zattera://node/{node_id}").try_into().unwrap()),
            SanType::DnsName(format!("node-{node_id}").try_into().unwrap()),
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let now = SystemTime::now();
        if expired {
            params.not_before = (now - Duration::from_secs(2 * 86_400)).into();
            params.not_after = (now - Duration::from_secs(86_400)).into();
        } else {
            params.not_before = (now - Duration::from_secs(300)).into();
            params.not_after = (now + Duration::from_secs(365 * 86_400)).into();
        }
        params
    }

    /// Signs a CSR as control does: its subject and SANs are replaced.
    pub fn sign_csr(&self, csr_pem: &str, node_id: &str) -> Result<String, rcgen::Error> {
        self.sign_csr_for(csr_pem, node_id, Duration::from_secs(365 * 86_400))
    }

    /// [`Self::sign_csr`] for a certificate valid from 5 minutes ago until
    /// `life` from now.
    pub fn sign_csr_for(
        &self,
        csr_pem: &str,
        node_id: &str,
        life: Duration,
    ) -> Result<String, rcgen::Error> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        csr.params = Self::node_params(node_id, false);
        // A short-lived certificate (a renewal test) starts now, so a third
        // of its life is a third of `life`.
        let now = SystemTime::now();
        if life < Duration::from_secs(3600) {
            csr.params.not_before = (now - Duration::from_secs(2)).into();
        }
        csr.params.not_after = (now + life).into();
        Ok(csr.signed_by(&self.issuer)?.pem())
    }

    /// A node certificate and key made directly (cert PEM, key PEM).
    pub fn node_identity(&self, node_id: &str, expired: bool) -> (String, String) {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = Self::node_params(node_id, expired)
            .signed_by(&key, &self.issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A node's TLS material presenting `identity` (cert PEM, key PEM) and
    /// trusting this CA.
    pub fn node_tls(&self, (cert, key): (String, String)) -> tls::NodeTls {
        tls::NodeTls {
            key_pem: key.into_bytes(),
            cert_pem: cert.into_bytes(),
            ca_pem: self.pem.clone().into_bytes(),
        }
    }

    /// A node-API client config presenting `identity` (cert PEM, key PEM)
    /// and trusting this CA.
    pub fn client_tls(&self, identity: (String, String)) -> rustls::ClientConfig {
        tls::node_client(&self.node_tls(identity)).unwrap()
    }
}
