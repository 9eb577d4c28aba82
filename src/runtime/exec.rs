//! Running a command inside a running container: health probes and
//! the exec API build on this.
//!
//! The process spec is the container's own (user, cwd, env, capabilities)
//! with other args. Output comes back through FIFOs the agent creates: each
//! is read to EOF on its own thread, which the runc shim delivers once the
//! process has exited and its output is copied, so nothing is cut short.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use containerd_client::services::v1::{
    DeleteProcessRequest, ExecProcessRequest, KillRequest, StartRequest, WaitRequest,
};
use nix::sys::stat::Mode;
use tonic::Code;

use super::connection::Containerd;
use super::containers;
use super::error::RuntimeError;
use super::spec::PROCESS_TYPE_URL;

/// Output kept per stream; the rest is read and dropped.
pub const MAX_CAPTURE: usize = 64 * 1024;
const SIGKILL: u32 = 9;

#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    pub args: Vec<String>,
    /// Initial terminal size `(cols, rows)` when run on a terminal.
    pub console_size: Option<(u32, u32)>,
    /// Extra `KEY=value` entries on top of the container's environment.
    pub env: Vec<String>,
    /// Working directory; the container's when empty.
    pub cwd: String,
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// The exit code; 137 when the timeout killed it.
    pub exit_code: u32,
    pub timed_out: bool,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `req` in container `id` and waits for it. `fifo_dir` is a private
/// directory where the output FIFOs are made (removed afterwards).
pub async fn exec(
    ctd: &Containerd,
    id: &str,
    fifo_dir: &Path,
    req: &ExecRequest,
) -> Result<ExecOutput, RuntimeError> {
    if req.args.is_empty() {
        return Err(RuntimeError::Invalid(format!(
            "exec in {id}: no command given"
        )));
    }
    let process_json = process_for(ctd, id, req, false).await?;

    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let exec_id = format!("exec-{nanos}");
    let dir = fifo_dir.join(&exec_id);
    let fifos = Fifos::create(&dir).map_err(|e| {
        RuntimeError::Invalid(format!("exec in {id}: fifos in {}: {e}", dir.display()))
    })?;
    let readers = fifos.spawn_readers();

    let result = run(ctd, id, &exec_id, &fifos, process_json, req.timeout).await;
    let (stdout, stderr) = if result.is_ok() {
        readers.collect()
    } else {
        readers.release_and_collect(&fifos)
    };
    let _ = std::fs::remove_dir_all(&dir);
    let (exit_code, timed_out) = result?;
    Ok(ExecOutput {
        exit_code,
        timed_out,
        stdout,
        stderr,
    })
}

/// The container's own process spec (user, env, capabilities) with `req`'s
/// args, cwd and extra env, as the JSON containerd's Exec takes.
pub(super) async fn process_for(
    ctd: &Containerd,
    id: &str,
    req: &ExecRequest,
    terminal: bool,
) -> Result<Vec<u8>, RuntimeError> {
    let container = containers::get(ctd, id)
        .await?
        .ok_or_else(|| RuntimeError::Invalid(format!("exec in {id}: no such container")))?;
    let spec: oci_spec::runtime::Spec = container
        .spec
        .as_ref()
        .map(|any| serde_json::from_slice(&any.value))
        .transpose()
        .map_err(|e| RuntimeError::Invalid(format!("exec in {id}: container spec: {e}")))?
        .ok_or_else(|| RuntimeError::Invalid(format!("exec in {id}: container has no spec")))?;
    let mut process = spec.process().clone().ok_or_else(|| {
        RuntimeError::Invalid(format!("exec in {id}: container spec has no process"))
    })?;
    process.set_args(Some(req.args.clone()));
    process.set_terminal(Some(terminal));
    if let (true, Some((cols, rows))) = (terminal, req.console_size) {
        // Set before the process starts: resizing afterwards would race
        // its first look at the terminal.
        let size = oci_spec::runtime::BoxBuilder::default()
            .width(u64::from(cols))
            .height(u64::from(rows))
            .build()
            .map_err(|e| RuntimeError::Invalid(format!("exec in {id}: console size: {e}")))?;
        process.set_console_size(Some(size));
    }
    if !req.cwd.is_empty() {
        process.set_cwd(PathBuf::from(&req.cwd));
    }
    if !req.env.is_empty() {
        let mut env = process.env().clone().unwrap_or_default();
        env.extend(req.env.iter().cloned());
        process.set_env(Some(env));
    }
    serde_json::to_vec(&process)
        .map_err(|e| RuntimeError::Invalid(format!("exec in {id}: encoding process: {e}")))
}

/// The host pid of an exec'd process.
async fn exec_pid(ctd: &Containerd, id: &str, exec_id: &str) -> Option<u32> {
    let got = ctd
        .tasks()
        .get(ctd.request(containerd_client::services::v1::GetRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
        }))
        .await
        .ok()?;
    got.into_inner().process.map(|p| p.pid).filter(|p| *p > 0)
}

/// SIGKILLs `root` and every descendant of it, from /proc (twice, for
/// children forked meanwhile).
fn kill_tree(root: u32) {
    for _ in 0..2 {
        let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                // `pid (comm) state ppid …`; comm may hold spaces and ')'.
                let ppid = stat
                    .rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()?;
                Some((pid, ppid))
            })
            .collect();
        let mut tree = vec![root];
        let mut i = 0;
        while i < tree.len() {
            let parent = tree[i];
            tree.extend(
                parents
                    .iter()
                    .filter(|(_, pp)| *pp == parent)
                    .map(|(p, _)| *p),
            );
            i += 1;
        }
        for pid in tree {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

async fn run(
    ctd: &Containerd,
    id: &str,
    exec_id: &str,
    fifos: &Fifos,
    process_json: Vec<u8>,
    timeout: Duration,
) -> Result<(u32, bool), RuntimeError> {
    let context = format!("exec {exec_id} in {id}");
    ctd.tasks()
        .exec(ctd.request(ExecProcessRequest {
            container_id: id.into(),
            stdin: String::new(),
            stdout: fifos.stdout.to_string_lossy().into_owned(),
            stderr: fifos.stderr.to_string_lossy().into_owned(),
            terminal: false,
            spec: Some(prost_types::Any {
                type_url: PROCESS_TYPE_URL.into(),
                value: process_json,
            }),
            exec_id: exec_id.into(),
        }))
        .await
        .map_err(RuntimeError::grpc(context.clone()))?;

    let outcome = async {
        // Wait is registered before start, so a fast exit cannot be missed.
        let mut tasks = ctd.tasks();
        let wait = tasks.wait(ctd.request(WaitRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
        }));
        ctd.tasks()
            .start(ctd.request(StartRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
            }))
            .await
            .map_err(RuntimeError::grpc(context.clone()))?;
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(r)) => Ok((r.into_inner().exit_status, false)),
            Ok(Err(s)) => Err(RuntimeError::grpc(context.clone())(s)),
            Err(_) => {
                // The whole tree: `sh -c 'sleep 1000; true'` leaves its
                // sleep behind when only sh is killed.
                if let Some(pid) = exec_pid(ctd, id, exec_id).await {
                    kill_tree(pid);
                }
                let _ = ctd
                    .tasks()
                    .kill(ctd.request(KillRequest {
                        container_id: id.into(),
                        exec_id: exec_id.into(),
                        signal: SIGKILL,
                        all: false,
                    }))
                    .await;
                let mut tasks = ctd.tasks();
                let waited = tasks.wait(ctd.request(WaitRequest {
                    container_id: id.into(),
                    exec_id: exec_id.into(),
                }));
                let code = tokio::time::timeout(Duration::from_secs(10), waited)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .map_or(128 + SIGKILL, |r| r.into_inner().exit_status);
                Ok((code, true))
            }
        }
    }
    .await;

    delete_process(ctd, id, exec_id).await;
    outcome
}

/// Deletes an exec process record; an absent one is fine.
pub(super) async fn delete_process(ctd: &Containerd, id: &str, exec_id: &str) {
    let deleted = ctd
        .tasks()
        .delete_process(ctd.request(DeleteProcessRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
        }))
        .await;
    if let Err(s) = deleted
        && s.code() != Code::NotFound
    {
        tracing::warn!(container = id, exec_id, error = %s.message(), "exec process not deleted");
    }
}

/// Makes one FIFO only the agent can open.
pub(super) fn make_fifo(path: &Path) -> std::io::Result<()> {
    nix::unistd::mkfifo(path, Mode::S_IRUSR | Mode::S_IWUSR).map_err(std::io::Error::from)
}

/// Gives a reader blocked opening `path` (whose writer never came) its
/// EOF: a writer that opens and closes. Fails until the reader waits in
/// open, so callers retry.
pub(super) fn poke_reader(path: &Path) {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = OpenOptions::new()
        .write(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path);
}

/// The two output FIFOs of one exec.
struct Fifos {
    stdout: PathBuf,
    stderr: PathBuf,
}

struct Readers {
    stdout: std::thread::JoinHandle<Vec<u8>>,
    stderr: std::thread::JoinHandle<Vec<u8>>,
}

impl Fifos {
    fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let this = Self {
            stdout: dir.join("stdout"),
            stderr: dir.join("stderr"),
        };
        for path in [&this.stdout, &this.stderr] {
            make_fifo(path)?;
        }
        Ok(this)
    }

    /// A blocking reader per FIFO: open waits for the shim's writer, and
    /// EOF means the process is done and its output fully copied.
    fn spawn_readers(&self) -> Readers {
        let spawn = |path: PathBuf| {
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                let Ok(mut file) = File::open(&path) else {
                    return kept;
                };
                let mut buf = [0u8; 8192];
                while let Ok(n) = file.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let room = MAX_CAPTURE.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
                kept
            })
        };
        Readers {
            stdout: spawn(self.stdout.clone()),
            stderr: spawn(self.stderr.clone()),
        }
    }
}

impl Readers {
    fn collect(self) -> (Vec<u8>, Vec<u8>) {
        (
            self.stdout.join().unwrap_or_default(),
            self.stderr.join().unwrap_or_default(),
        )
    }

    /// Unblocks readers whose writer never came (the exec failed early): a
    /// writer that opens and closes gives them EOF. A non-blocking open for
    /// writing succeeds once the reader waits in open, so retry briefly.
    fn release_and_collect(self, fifos: &Fifos) -> (Vec<u8>, Vec<u8>) {
        for _ in 0..100 {
            let pending: Vec<&PathBuf> =
                [(&self.stdout, &fifos.stdout), (&self.stderr, &fifos.stderr)]
                    .into_iter()
                    .filter(|(h, _)| !h.is_finished())
                    .map(|(_, p)| p)
                    .collect();
            if pending.is_empty() {
                break;
            }
            for path in pending {
                poke_reader(path);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.collect()
    }
}
