//! One gateway's listener: its UDP sockets and TCP socket, and the tasks
//! serving them. Closing the listener ends those tasks, which closes the
//! sockets and every connection and forward they own.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::task::JoinSet;

use crate::context::ListenerCtx;
use crate::error::BindError;
use crate::tcp;
use crate::udp::UdpWorker;

/// Pending TCP connections the kernel queues for us.
const TCP_BACKLOG: i32 = 1024;

#[derive(Debug)]
pub(crate) struct Listener {
    pub(crate) ctx: Arc<ListenerCtx>,
    udp: Vec<UdpWorker>,
    tasks: JoinSet<()>,
}

impl Listener {
    /// Binds every socket first and starts serving only if all succeeded,
    /// so a half-open listener never exists: a failure leaves nothing bound.
    pub(crate) fn open(
        addr: SocketAddr,
        udp_sockets: usize,
        freebind: bool,
        ctx: Arc<ListenerCtx>,
    ) -> Result<Self, BindError> {
        let count = udp_sockets.max(1);
        let mut udp = Vec::with_capacity(count);
        for _ in 0..count {
            let socket = udp_socket(addr, count > 1, freebind)
                .map_err(|source| BindError::Udp { addr, source })?;
            udp.push(socket);
        }
        let tcp = tcp_listener(addr, freebind).map_err(|source| BindError::Tcp { addr, source })?;
        let runtime = Handle::try_current().map_err(|e| BindError::Udp {
            addr,
            source: io::Error::other(e),
        })?;
        // A worker that fails to start drops the ones before it: they stop.
        let udp = udp
            .into_iter()
            .map(|socket| UdpWorker::spawn(socket, Arc::clone(&ctx), runtime.clone()))
            .collect::<io::Result<Vec<_>>>()
            .map_err(|source| BindError::Udp { addr, source })?;
        let mut tasks = JoinSet::new();
        tasks.spawn(tcp::serve(tcp, Arc::clone(&ctx)));
        Ok(Self { ctx, udp, tasks })
    }

    /// Stops serving and waits until the sockets are really closed, so the
    /// same address can be bound again right away.
    pub(crate) async fn close(mut self) {
        for worker in &self.udp {
            worker.stop();
        }
        for worker in self.udp.drain(..) {
            worker.join().await;
        }
        self.tasks.shutdown().await;
    }
}

fn socket(addr: SocketAddr, kind: Type, protocol: Protocol, freebind: bool) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), kind, Some(protocol))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    if freebind {
        if addr.is_ipv4() {
            socket.set_freebind_v4(true)?;
        } else {
            socket.set_freebind_v6(true)?;
        }
    }
    socket.set_nonblocking(true)?;
    Ok(socket)
}

fn udp_socket(
    addr: SocketAddr,
    reuse_port: bool,
    freebind: bool,
) -> io::Result<std::net::UdpSocket> {
    let s = socket(addr, Type::DGRAM, Protocol::UDP, freebind)?;
    // Only our own sockets share the port; set on a single socket it would
    // let another process silently split our traffic.
    if reuse_port {
        s.set_reuse_port(true)?;
    }
    s.bind(&addr.into())?;
    Ok(s.into())
}

fn tcp_listener(addr: SocketAddr, freebind: bool) -> io::Result<TcpListener> {
    let s = socket(addr, Type::STREAM, Protocol::TCP, freebind)?;
    // Rebinding while old connections sit in TIME_WAIT must work.
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(TCP_BACKLOG)?;
    TcpListener::from_std(s.into())
}
