"""Prefill/decode disaggregation: `surge proxy`, the front that sends a request's prefill leg to one instance and
its decode leg, with the returned kv_transfer_params, to another, passing the bodies through as bytes."""
