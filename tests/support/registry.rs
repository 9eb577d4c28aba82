//! A real OCI registry (Debian's `docker-registry`) on a loopback port,
//! filled with `skopeo`, for pull tests. Killed when dropped.

use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

#[derive(Debug)]
pub struct Registry {
    pub addr: SocketAddr,
    credentials: Option<(String, String)>,
    child: Child,
    dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry; with `credentials`, it requires htpasswd basic auth.
    pub fn start(credentials: Option<(&str, &str)>) -> Self {
        Self::start_with(credentials, None)
    }

    /// [`Self::start`] serving TLS with `tls` (certificate chain PEM, key PEM).
    pub fn start_with(credentials: Option<(&str, &str)>, tls: Option<(&str, &str)>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        if let Some((chain, key)) = tls {
            let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
            std::fs::write(&cert_path, chain).unwrap();
            std::fs::write(&key_path, key).unwrap();
            let _ = write!(
                config,
                "  tls:\n    certificate: {}\n    key: {}\n",
                cert_path.display(),
                key_path.display()
            );
        }
        if let Some((user, password)) = credentials {
            let hash = bcrypt::hash(password, 4).unwrap();
            std::fs::write(dir.path().join("htpasswd"), format!("{user}:{hash}\n")).unwrap();
            let htpasswd = dir.path().join("htpasswd");
            let _ = write!(
                config,
                "auth:\n  htpasswd:\n    realm: zattera-test\n    path: {}\n",
                htpasswd.display()
            );
        }
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry (apt install docker-registry)");
        for _ in 0..100 {
            if TcpStream::connect(addr).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            addr,
            credentials: credentials.map(|(u, p)| (u.to_owned(), p.to_owned())),
            child,
            dir,
        }
    }

    /// Pushes an OCI archive (all platforms) as `<addr>/<repo_tag>`.
    pub fn push(&self, archive: &Path, archive_ref: Option<&str>, repo_tag: &str) -> String {
        let source = match archive_ref {
            Some(r) => format!("oci-archive:{}:{r}", archive.display()),
            None => format!("oci-archive:{}", archive.display()),
        };
        let dest = format!("{}/{repo_tag}", self.addr);
        let mut cmd = Command::new("skopeo");
        cmd.args([
            "copy",
            "--quiet",
            "--insecure-policy",
            "--dest-tls-verify=false",
            "--all",
        ]);
        if let Some((u, p)) = &self.credentials {
            cmd.arg("--dest-creds").arg(format!("{u}:{p}"));
        }
        let out = cmd
            .arg(source)
            .arg(format!("docker://{dest}"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "skopeo: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dest
    }

    /// The registry's own file for a blob, to corrupt it behind its back.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Registry {
    /// The digest of the largest blob stored (a layer).
    pub fn largest_blob(&self) -> String {
        let root = self.dir.path().join("data/docker/registry/v2/blobs/sha256");
        let hex = std::fs::read_dir(root)
            .unwrap()
            .flatten()
            .flat_map(|prefix| std::fs::read_dir(prefix.path()).unwrap().flatten())
            .max_by_key(|d| std::fs::metadata(d.path().join("data")).map_or(0, |m| m.len()))
            .expect("the registry holds blobs")
            .file_name()
            .into_string()
            .unwrap();
        format!("sha256:{hex}")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
