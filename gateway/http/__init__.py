"""HTTP pieces every route uses: the refused-request error and server-sent-event framing."""
