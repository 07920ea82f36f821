package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// fakeKubelet is the kubelet's Registration service on dir/kubelet.sock.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	srv  *grpc.Server
	reqs chan *pluginapi.RegisterRequest
}

func startKubelet(t *testing.T, dir string) *fakeKubelet {
	t.Helper()
	ln, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	k := &fakeKubelet{srv: grpc.NewServer(), reqs: make(chan *pluginapi.RegisterRequest, 4)}
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go k.srv.Serve(ln)
	return k
}

func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.reqs <- r
	return &pluginapi.Empty{}, nil
}

func (k *fakeKubelet) waitRegister(t *testing.T) *pluginapi.RegisterRequest {
	t.Helper()
	select {
	case r := <-k.reqs:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no Register call")
		return nil
	}
}

func TestPlugin(t *testing.T) {
	dir, err := os.MkdirTemp("", "dp") // short: unix socket paths are limited to 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	kubelet := startKubelet(t, dir)
	defer func() { kubelet.srv.Stop() }()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() {
		done <- run(ctx, config{resource: "nvidia.com/gpu", count: 3, dir: dir, poll: 50 * time.Millisecond})
	}()
	defer func() { cancel(); <-done }()

	r := kubelet.waitRegister(t)
	if r.ResourceName != "nvidia.com/gpu" || r.Version != pluginapi.Version || r.Endpoint != "kvpilot-nvidia.com-gpu.sock" {
		t.Fatalf("Register got %v", r)
	}

	// Talk to the plugin as the kubelet does: its endpoint is relative to dir.
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, r.Endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := pluginapi.NewDevicePluginClient(conn)

	opts, err := c.GetDevicePluginOptions(ctx, &pluginapi.Empty{})
	if err != nil || !opts.GetPreferredAllocationAvailable {
		t.Fatalf("GetDevicePluginOptions: %v %v", opts, err)
	}
	stream, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, d := range list.Devices {
		if d.Health != pluginapi.Healthy {
			t.Errorf("device %s is %s", d.ID, d.Health)
		}
		ids = append(ids, d.ID)
	}
	if !slices.Equal(ids, []string{"gpu-0", "gpu-1", "gpu-2"}) {
		t.Fatalf("ListAndWatch devices %v", ids)
	}

	pref, err := c.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: []string{"gpu-0", "gpu-1", "gpu-2"}, MustIncludeDeviceIDs: []string{"gpu-2"}, AllocationSize: 2},
	}})
	if err != nil || !slices.Equal(pref.ContainerResponses[0].DeviceIDs, []string{"gpu-2", "gpu-0"}) {
		t.Fatalf("GetPreferredAllocation: %v %v", pref, err)
	}

	alloc, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: []string{"gpu-0", "gpu-2"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	cr := alloc.ContainerResponses[0]
	if len(cr.Envs) != 1 || cr.Envs[EnvVar] != "gpu-0,gpu-2" || len(cr.Devices) != 0 || len(cr.Mounts) != 0 {
		t.Fatalf("Allocate: %v", cr)
	}
	if _, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: []string{"gpu-9"}},
	}}); err == nil {
		t.Error("Allocate of an unknown device succeeded")
	}
	if _, err := c.PreStartContainer(ctx, &pluginapi.PreStartContainerRequest{DevicesIds: []string{"gpu-0"}}); err != nil {
		t.Error(err)
	}

	// A kubelet restart: kubelet.sock is re-created and the plugin's socket
	// deleted; the plugin must serve again and register again.
	kubelet.srv.Stop()
	os.Remove(filepath.Join(dir, "kubelet.sock"))
	os.Remove(filepath.Join(dir, r.Endpoint))
	kubelet = startKubelet(t, dir)
	r = kubelet.waitRegister(t)
	if r.ResourceName != "nvidia.com/gpu" {
		t.Fatalf("second Register got %v", r)
	}
	if _, err := os.Stat(filepath.Join(dir, r.Endpoint)); err != nil {
		t.Fatalf("plugin socket after re-registration: %v", err)
	}
	conn2, err := grpc.NewClient("unix://"+filepath.Join(dir, r.Endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close()
	stream, err = pluginapi.NewDevicePluginClient(conn2).ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	if list, err = stream.Recv(); err != nil || len(list.Devices) != 3 {
		t.Fatalf("ListAndWatch after re-registration: %v %v", list, err)
	}
}
