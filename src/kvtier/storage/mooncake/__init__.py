"""The Mooncake backend: ``store`` over Mooncake Store's client; ``config`` its options and the
process environment it needs; ``local`` a master and store node this machine runs itself."""
