//! The framing of an interactive `exec` on the admin socket, after its
//! request line: `[kind u8][length u32 BE][payload]`, both ways. The
//! client sends stdin, terminal sizes and the end of stdin; the agent sends
//! output, then the exit code (or an error) as the last frame.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A frame larger than this is a broken peer.
const MAX_PAYLOAD: u32 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Stdin(Vec<u8>),
    Resize { cols: u16, rows: u16 },
    StdinEnd,
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(i32),
    Error(String),
}

pub async fn write<W: AsyncWrite + Unpin>(w: &mut W, frame: &Frame) -> std::io::Result<()> {
    let (kind, payload): (u8, Vec<u8>) = match frame {
        Frame::Stdin(b) => (0, b.clone()),
        Frame::Resize { cols, rows } => (1, [cols.to_be_bytes(), rows.to_be_bytes()].concat()),
        Frame::StdinEnd => (2, Vec::new()),
        Frame::Stdout(b) => (3, b.clone()),
        Frame::Stderr(b) => (4, b.clone()),
        Frame::Exit(code) => (5, code.to_be_bytes().to_vec()),
        Frame::Error(e) => (6, e.as_bytes().to_vec()),
    };
    let len = u32::try_from(payload.len()).map_err(std::io::Error::other)?;
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(kind);
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&payload);
    w.write_all(&buf).await?;
    w.flush().await
}

/// The next frame; `None` at a clean end of the stream.
pub async fn read<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<Frame>> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("exec frame of {len} bytes"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed exec frame");
    Ok(Some(match head[0] {
        0 => Frame::Stdin(payload),
        1 if payload.len() == 4 => Frame::Resize {
            cols: u16::from_be_bytes([payload[0], payload[1]]),
            rows: u16::from_be_bytes([payload[2], payload[3]]),
        },
        2 => Frame::StdinEnd,
        3 => Frame::Stdout(payload),
        4 => Frame::Stderr(payload),
        5 if payload.len() == 4 => Frame::Exit(i32::from_be_bytes([
            payload[0], payload[1], payload[2], payload[3],
        ])),
        6 => Frame::Error(String::from_utf8_lossy(&payload).into_owned()),
        _ => return Err(bad()),
    }))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_garbage_is_an_error() {
        let frames = [
            Frame::Stdin(b"ls\n".to_vec()),
            Frame::Resize {
                cols: 120,
                rows: 40,
            },
            Frame::StdinEnd,
            Frame::Stdout(vec![0, 255]),
            Frame::Stderr(Vec::new()),
            Frame::Exit(-3),
            Frame::Error("no".into()),
        ];
        let mut buf = Vec::new();
        for f in &frames {
            write(&mut buf, f).await.unwrap();
        }
        let mut r = &buf[..];
        for f in &frames {
            assert_eq!(read(&mut r).await.unwrap().as_ref(), Some(f));
        }
        assert_eq!(read(&mut r).await.unwrap(), None);
        for garbage in [
            &[9u8, 0, 0, 0, 0][..],
            &[0, 0xff, 0xff, 0xff, 0xff],
            &[1, 0, 0, 0, 1, 7],
        ] {
            assert!(read(&mut &garbage[..]).await.is_err(), "{garbage:?}");
        }
    }
}
