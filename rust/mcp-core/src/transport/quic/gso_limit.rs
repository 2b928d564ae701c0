//! A quinn socket whose segmentation-offload batches fit one `sendmsg`.
//!
//! Linux takes at most 64 KiB of UDP payload per call, a GSO batch included; a larger one
//! fails with `EMSGSIZE`, which quinn-udp treats as sent (it expects that error from MTU
//! probes only). quinn batches up to 10 datagrams of the path's MTU, so on a path with
//! jumbo frames (`mtu` 8,972 on a 9,000-byte link: 90 KB a batch) every full batch vanished
//! and a 1 MiB all-reduce stalled until its timeout. This wrapper tells quinn to batch no
//! more datagrams than fit.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// UDP payload one `sendmsg` may carry, with room for the IPv6 and UDP headers within the
/// 65,535 bytes of an IP packet.
pub(crate) const SENDMSG_PAYLOAD: usize = 65_000;

/// Datagrams of `max_datagram` bytes that fit one `sendmsg` (at least one).
pub(crate) fn segments_per_call(max_datagram: u16) -> usize {
    (SENDMSG_PAYLOAD / usize::from(max_datagram.max(1))).max(1)
}

/// Wraps a quinn socket, capping its GSO batches at [`segments_per_call`] of the largest
/// datagram its connections may send.
#[derive(Debug)]
pub(crate) struct GsoLimit {
    inner: Arc<dyn AsyncUdpSocket>,
    max_segments: usize,
}

impl GsoLimit {
    /// `max_datagram`: the largest UDP payload any connection of the endpoint may send (the
    /// upper bound of its MTU discovery).
    pub(crate) fn over(inner: Arc<dyn AsyncUdpSocket>, max_datagram: u16) -> Arc<GsoLimit> {
        Arc::new(GsoLimit {
            inner,
            max_segments: segments_per_call(max_datagram),
        })
    }
}

impl AsyncUdpSocket for GsoLimit {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, t: &Transmit<'_>) -> io::Result<()> {
        self.inner.try_send(t)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        // The inner socket's figure can fall to 1 at run time (the kernel refused GSO).
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(usize);

    impl AsyncUdpSocket for Fixed {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            unreachable!("not polled in these tests")
        }
        fn try_send(&self, _: &Transmit<'_>) -> io::Result<()> {
            Ok(())
        }
        fn poll_recv(
            &self,
            _: &mut Context<'_>,
            _: &mut [IoSliceMut<'_>],
            _: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok(SocketAddr::from(([127, 0, 0, 1], 9)))
        }
        fn max_transmit_segments(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn a_batch_of_the_largest_datagrams_fits_one_call() {
        for mtu in [
            1200u16, 1452, 1472, 4000, 8972, 9000, 16_000, 32_500, 65_000,
        ] {
            let n = segments_per_call(mtu);
            assert!(n * usize::from(mtu) <= SENDMSG_PAYLOAD, "{mtu}: {n}");
            assert!(
                n == 1 || (n + 1) * usize::from(mtu) > SENDMSG_PAYLOAD,
                "{mtu}: {n}"
            );
        }
        assert_eq!(segments_per_call(1452), 44);
        assert_eq!(segments_per_call(8972), 7);
        assert_eq!(segments_per_call(65_000), 1);
    }

    #[test]
    fn the_cap_and_the_inner_sockets_figure_whichever_is_lower() {
        let jumbo = GsoLimit::over(Arc::new(Fixed(64)), 8972);
        assert_eq!(jumbo.max_transmit_segments(), 7);
        let ethernet = GsoLimit::over(Arc::new(Fixed(64)), 1452);
        assert_eq!(ethernet.max_transmit_segments(), 44);
        let halted = GsoLimit::over(Arc::new(Fixed(1)), 1452);
        assert_eq!(halted.max_transmit_segments(), 1);
    }
}
