//! `--metrics ADDR`: the node's Prometheus metrics over HTTP/1.1 (hyper), in the text format
//! of `prometheus-client` (OpenMetrics). A scraper's GET is all it serves; anything else is
//! answered 404/405, and a connection that idles is closed.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;

/// The content type of `prometheus_client::encoding::text` (what Prometheus negotiates).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Longest a connection may stay open (a scrape takes milliseconds; a slow client that
/// holds sockets open is cut off).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Serve `reg` at `/metrics` on `listener` until the listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    reg: Arc<Mutex<Registry>>,
) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let reg = reg.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let r = respond(&req, &reg);
                async move { Ok::<_, Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), svc);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
        });
    }
}

fn respond(req: &Request<Incoming>, reg: &Mutex<Registry>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, ctype: &str, body: String| {
        Response::builder()
            .status(status)
            .header(hyper::header::CONTENT_TYPE, ctype)
            .body(Full::new(Bytes::from(body)))
            .expect("a static response builds")
    };
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "text/plain", "try /metrics\n".into());
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET /metrics\n".into(),
        );
    }
    let mut text = String::new();
    let reg = reg.lock().unwrap_or_else(|e| e.into_inner());
    match prometheus_client::encoding::text::encode(&mut text, &reg) {
        Ok(()) => reply(StatusCode::OK, CONTENT_TYPE, text),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            format!("encoding the metrics: {e}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::gauge::Gauge;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: std::net::SocketAddr, req: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connects");
        s.write_all(req.as_bytes()).await.expect("writes");
        let mut out = Vec::new();
        // A refused request may end in a reset: what arrived before it is the answer.
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn a_scrape_gets_the_registered_metrics_and_nothing_else_is_served() {
        let mut reg = Registry::default();
        let g: Gauge = Gauge::default();
        g.set(42);
        reg.register("swarm_version", "Parameter version", g.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let addr = l.local_addr().expect("an address");
        tokio::spawn(serve(l, Arc::new(Mutex::new(reg))));

        let ok = get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains(CONTENT_TYPE), "{ok}");
        assert!(ok.contains("# TYPE swarm_version gauge"), "{ok}");
        assert!(ok.contains("swarm_version 42"), "{ok}");
        assert!(ok.trim_end().ends_with("# EOF"), "{ok}");

        g.set(43);
        let again = get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(again.contains("swarm_version 43"), "{again}");

        let nf = get(
            addr,
            "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(nf.starts_with("HTTP/1.1 404"), "{nf}");
        let post = get(
            addr,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let junk = get(addr, "\x16\x03\x01 not http at all\r\n\r\n").await;
        assert!(!junk.contains("swarm_version"), "{junk}");
    }
}
