//! Release channels over plain HTTP on loopback: a small file server, and
//! a channel laid out as the reference's (and this agent's): `<base>/
//! download/<tag>/<asset>` beside `sha256sums.txt`.

use super::*;
use std::path::PathBuf;

/// Serves the file `body` at `path` over plain HTTP on loopback, 404
/// elsewhere.
pub async fn serve_file(path: &str, body: PathBuf) -> (String, AbortOnDrop) {
    serve(vec![(path.to_owned(), Route::File(body))]).await
}

/// What [`serve`] answers on a path.
#[derive(Clone, Debug)]
pub enum Route {
    File(PathBuf),
    /// A 302 to this URL.
    Redirect(String),
}

/// A loopback HTTP/1.1 server of `routes` (404 elsewhere); its address.
pub async fn serve(routes: Vec<(String, Route)>) -> (String, AbortOnDrop) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let routes = Arc::new(routes);
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let routes = Arc::clone(&routes);
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&req);
                let route = routes
                    .iter()
                    .find(|(path, _)| line.starts_with(&format!("GET {path} ")))
                    .map(|(_, r)| r.clone());
                let head = match &route {
                    Some(Route::File(body)) => {
                        let len = std::fs::metadata(body).map_or(0, |m| m.len());
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
                        )
                    }
                    Some(Route::Redirect(to)) => format!(
                        "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    ),
                    None => {
                        "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_owned()
                    }
                };
                let _ = conn.write_all(head.as_bytes()).await;
                if let Some(Route::File(body)) = &route
                    && let Ok(mut file) = tokio::fs::File::open(body).await
                {
                    let _ = tokio::io::copy(&mut file, &mut conn).await;
                }
                let _ = conn.shutdown().await;
            });
        }
    });
    (addr, AbortOnDrop(task))
}

/// A release channel at `http://<addr>/releases` holding, for each tag,
/// this agent's binary stamped with that tag (the build's own, copied)
/// under this machine's asset name, and its `sha256sums.txt`.
pub struct ReleaseChannel {
    pub base: String,
    /// Each tag's asset: (tag, path, sha256).
    pub assets: Vec<(String, PathBuf, String)>,
    _dir: tempfile::TempDir,
    _server: AbortOnDrop,
}

impl ReleaseChannel {
    pub async fn serve(binary: &std::path::Path, tags: &[&str]) -> Self {
        use sha2::Digest;
        let dir = tempfile::tempdir().unwrap();
        let asset = zattera_agent::upgrade::asset_name();
        let mut routes = Vec::new();
        let mut assets = Vec::new();
        for tag in tags {
            let tag_dir = dir.path().join(tag);
            std::fs::create_dir_all(&tag_dir).unwrap();
            let file = tag_dir.join(&asset);
            std::fs::copy(binary, &file).unwrap();
            zattera_agent::version::stamp(&file, tag).unwrap();
            let mut h = sha2::Sha256::new();
            std::io::copy(&mut std::fs::File::open(&file).unwrap(), &mut h).unwrap();
            let digest = hex::encode(h.finalize());
            let sums = tag_dir.join("sha256sums.txt");
            std::fs::write(
                &sums,
                format!(
                    "{}  zattera-linux-amd64\n{digest}  {asset}\n",
                    "0".repeat(64)
                ),
            )
            .unwrap();
            routes.push((
                format!("/releases/download/{tag}/{asset}"),
                Route::File(file.clone()),
            ));
            routes.push((
                format!("/releases/download/{tag}/sha256sums.txt"),
                Route::File(sums),
            ));
            assets.push(((*tag).to_owned(), file, digest));
        }
        let (addr, server) = serve(routes).await;
        Self {
            base: format!("http://{addr}/releases"),
            assets,
            _dir: dir,
            _server: server,
        }
    }
}
