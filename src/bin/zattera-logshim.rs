//! `zattera-logshim`: the logger containerd's runc shim runs for each
//! container (`binary://` log URI), writing its output as CRI lines with
//! rotation and compression ([`zattera_agent::logs::shim`]).
//!
//! One runs per container for the container's whole life, so its size is
//! the node's cost per instance: this binary holds the log shim alone,
//! where the agent binary (which can also serve as the shim) carries every
//! other part's relocated data into each process.

use std::process::ExitCode;

use zattera_agent::logs::shim;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(args) = shim::invoked_as_shim(&args) else {
        eprintln!(
            "zattera-logshim: started by containerd's runc shim as a container's logger \
             (`{} PATH [{} SECS] [{} BYTES]`), not by hand",
            shim::ARG,
            shim::ARG_MAX_AGE,
            shim::ARG_MAX_BYTES
        );
        return ExitCode::from(2);
    };
    match shim::run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zattera-logshim {}: {e}", args.log_path.display());
            ExitCode::FAILURE
        }
    }
}
