#!/bin/sh
# Issues this pod's certificate for mutual TLS, signed by the cluster's CA (Secret kvconductor-ca).
# Per pod, because the services dial each other at the pod IPs they register in etcd, which no shared
# certificate can name (cert-manager's csi-driver cannot issue for a pod IP either: cert-manager/csi-driver#17).
# Every leaf carries the same DNS names: any CA-signed certificate is already trusted by every service, so
# narrower names per role would add nothing. Runs in an init container; only that container sees the CA key.
set -eu
ca=/etc/kvconductor/ca
cd /var/run/kvconductor/tls
openssl req -new -newkey rsa:2048 -nodes -keyout tls.key -out tls.csr -subj "/CN=$POD_NAME" 2>/dev/null
ns=$POD_NAMESPACE
cat > ext.cnf <<END
subjectAltName=IP:$POD_IP,IP:127.0.0.1,DNS:localhost,DNS:$POD_NAME.kvconductor-etcd,DNS:$POD_NAME.kvconductor-etcd.$ns.svc,DNS:kvconductor-conductor,DNS:kvconductor-conductor.$ns.svc
extendedKeyUsage=serverAuth,clientAuth
END
# 90 days: the services read their certificate once at start, so a pod older than that must be restarted.
openssl x509 -req -in tls.csr -CA $ca/tls.crt -CAkey $ca/tls.key -set_serial "0x$(openssl rand -hex 16)" \
  -days 90 -extfile ext.cnf -out tls.crt 2>/dev/null
cp $ca/tls.crt ca.crt
rm tls.csr ext.cnf
