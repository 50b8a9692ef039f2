#!/bin/sh
# Issues this pod's certificate for mutual TLS, signed by the cluster's CA (Secret kvconductor-ca).
# Per pod, because the services dial each other at the pod IPs they register in etcd, which no shared
# certificate can name (cert-manager's csi-driver cannot issue for a pod IP either: cert-manager/csi-driver#17).
# Per role, too: ROLE (the pod's label app.kubernetes.io/component, tls-patch.yaml) goes in as the URI SAN
# spiffe://kvconductor/ROLE, from which every gRPC server decides what the caller may call
# (services/common/access.py), and as the common name, which etcd takes as the user (cli/etcd_roles.py
# gives each role's user its records); only the Conductor's pods are named as its Service, only etcd's as
# its members. The etcd-roles Job gets etcd's root user's certificate. Runs in an init container; only that
# container sees the CA key.
set -eu
ca=${CA_DIR:-/etc/kvconductor/ca}
cd "${TLS_DIR:-/var/run/kvconductor/tls}"
ns=$POD_NAMESPACE
sans="IP:$POD_IP,IP:127.0.0.1,DNS:localhost"
usage=serverAuth,clientAuth  # every gRPC process serves and calls; etcd members are each other's clients
cn=$ROLE
case $ROLE in
  etcd) sans="$sans,DNS:$POD_NAME.kvconductor-etcd,DNS:$POD_NAME.kvconductor-etcd.$ns.svc" cn=$POD_NAME ;;  # no role
  etcd-roles) cn=root usage=clientAuth ;;  # etcd's root user, for the Job that sets up the others
  conductor) sans="URI:spiffe://kvconductor/$ROLE,$sans,DNS:kvconductor-conductor,DNS:kvconductor-conductor.$ns.svc" ;;
  gateway) sans="URI:spiffe://kvconductor/$ROLE,$sans" usage=clientAuth ;;  # serves REST only, not with this certificate
  kvmeta | store | prefill | decode | colocated | admin) sans="URI:spiffe://kvconductor/$ROLE,$sans" ;;
  *) echo "issue-cert.sh: unknown ROLE '$ROLE' (the pod's label app.kubernetes.io/component)" >&2; exit 1 ;;
esac
openssl req -new -newkey rsa:2048 -nodes -keyout tls.key -out tls.csr -subj "/CN=$cn" 2>/dev/null
cat > ext.cnf <<END
subjectAltName=$sans
extendedKeyUsage=$usage
END
# 90 days: the services read their certificate once at start, so a pod older than that must be restarted.
openssl x509 -req -in tls.csr -CA "$ca/tls.crt" -CAkey "$ca/tls.key" -set_serial "0x$(openssl rand -hex 16)" \
  -days 90 -extfile ext.cnf -out tls.crt 2>/dev/null
cp "$ca/tls.crt" ca.crt
rm tls.csr ext.cnf
