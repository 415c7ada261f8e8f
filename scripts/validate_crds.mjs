// Validate the chart's custom resources against the JSON schemas of their API types, as
// compiled from the projects' CRDs by the npm packages @kubernetes-models/prometheus-operator
// (ServiceMonitor, PrometheusRule: monitoring.coreos.com/v1), @kubernetes-models/cert-manager
// (Certificate: cert-manager.io/v1), @kubernetes-models/keda (ScaledObject,
// TriggerAuthentication: keda.sh/v1alpha1) and @kubernetes-models/gateway-api (GRPCRoute,
// BackendTLSPolicy: gateway.networking.k8s.io/v1), installed into .tools/node by
// scripts/deploy_tools.sh.
//
//   node scripts/validate_crds.mjs < resources.json     # a JSON array of objects
//
// Prints one line per object; exits 1 if any is invalid, 2 if a kind is not covered.
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const root = process.env.NOETL_TOOLS_NODE || path.resolve(process.cwd(), ".tools/node");
const require = createRequire(path.join(root, "package.json"));
const kinds = {};
const models = [
  ["@kubernetes-models/prometheus-operator", "monitoring.coreos.com/v1", ["ServiceMonitor", "PrometheusRule", "PodMonitor"]],
  ["@kubernetes-models/cert-manager", "cert-manager.io/v1", ["Certificate", "Issuer", "ClusterIssuer"]],
  ["@kubernetes-models/keda", "keda.sh/v1alpha1", ["ScaledObject", "TriggerAuthentication"]],
  ["@kubernetes-models/gateway-api", "gateway.networking.k8s.io/v1", ["GRPCRoute", "BackendTLSPolicy", "Gateway"]],
];
for (const [pkg, group, names] of models) {
  const pkgDir = path.dirname(require.resolve(`${pkg}/package.json`));
  for (const kind of names) {
    const mod = await import(pathToFileURL(path.join(pkgDir, group, `${kind}.js`)).href);
    kinds[`${group}/${kind}`] = mod[kind];
  }
}

const objects = JSON.parse(readFileSync(0, "utf8"));
let bad = 0;
let uncovered = 0;
for (const obj of objects) {
  const key = `${obj.apiVersion}/${obj.kind}`;
  const name = `${obj.kind}/${obj.metadata?.name}`;
  const Model = kinds[key];
  if (!Model) {
    console.log(`UNCOVERED ${name}: no schema for ${key}`);
    uncovered++;
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(`OK ${name} (${key})`);
  } catch (err) {
    bad++;
    console.log(`INVALID ${name}: ${err.message}`);
    for (const e of err.errors || []) console.log(`  ${e.instancePath} ${e.message} ${JSON.stringify(e.params)}`);
  }
}
process.exit(bad ? 1 : uncovered ? 2 : 0);
